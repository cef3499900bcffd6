"""`dtorch ckpt export RUN OUT --hf` of a `dtorch train` run needs no `--model`: the run records the
model spec next to its checkpoints, and the export builds the Hugging Face config from it."""

from __future__ import annotations

import json

import pytest
import torch

SPEC = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"


def test_export_takes_the_recorded_spec_and_transformers_loads_the_same_model(tmp_path, capsys):
    from dtorch.checkpoint import CheckpointManager
    from dtorch.checkpoint.export import save_run_model
    from dtorch.cli import main as cli_main
    from dtorch.models import build_model

    torch.manual_seed(0)
    model = build_model(SPEC).eval()
    root = tmp_path / "run"
    mgr = CheckpointManager(root)
    mgr.save(1, {"model": model.state_dict()})
    mgr.close()
    assert cli_main(["ckpt", "export", str(root), str(tmp_path / "none"), "--hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "this run recorded no model" in err[0] and "--model SPEC" in err[0]

    save_run_model(root, SPEC)  # what `dtorch train` writes at its start
    assert cli_main(["ckpt", "export", str(root), str(tmp_path / "hf"), "--hf"]) == 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["n_layer"] == 2 and cfg["vocab_size"] == 64
    assert cfg["bos_token_id"] is None and cfg["eos_token_id"] is None  # GPT-2's 50256 is no token here
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        ours, got = model(tokens), theirs(tokens).logits
    assert torch.allclose(got, ours, rtol=1e-5, atol=1e-5)
