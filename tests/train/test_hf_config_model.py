"""`dtorch train --model config.json`: the transformers model a Hugging Face config describes,
trained from random weights, as `dtorch plan --model config.json` plans it. BLOOM is the example:
no adapter understands it (embedding LayerNorm, ALiBi), so it runs its own forward."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from dtorch.errors import ConfigError  # noqa: E402
from dtorch.model import model_factory_of, spec_vocab  # noqa: E402

BLOOM = {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "n_layer": 2, "hidden_size": 32,
         "n_head": 4, "vocab_size": 256, "hidden_dropout": 0.0, "attention_dropout": 0.0}


@pytest.fixture
def bloom_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(BLOOM))
    return path


def test_a_config_json_builds_the_transformers_model(bloom_config, tmp_path) -> None:
    model = model_factory_of(str(bloom_config))()
    assert type(model).__name__ == "BloomForCausalLM" and model.config.n_layer == 2
    assert spec_vocab(str(bloom_config)) == 256 and spec_vocab("gpt:layers=1,hidden=32,heads=2,vocab=300") == 300
    other = tmp_path / "vit.json"  # an image encoder: no causal LM of its type
    other.write_text(json.dumps({"architectures": ["ViTModel"], "model_type": "vit"}))
    with pytest.raises(ConfigError) as err:
        model_factory_of(str(other))
    assert err.value.value == str(other) and "not a causal language model" in err.value.fix


def test_generation_reads_the_logits_of_a_model_output(bloom_config) -> None:
    from dtorch.train.generate import generate

    torch.manual_seed(0)
    out = generate(model_factory_of(str(bloom_config))(), torch.tensor([1, 2, 3]), 5, context=16)
    assert out.shape == (8,) and out[:3].tolist() == [1, 2, 3]


def test_dtorch_train_trains_a_config_json(bloom_config, tmp_path) -> None:
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "dtorch.cli", "train", "--model", str(bloom_config), "--steps", "3",
                           "--nproc", "1", "--sample-tokens", "4", "--no-progress", "--run-dir", str(run),
                           "--checkpoint-dir", str(run / "ckpt")], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("dtorch: {"))[8:])
    assert summary["final_step"] == 3 and summary["final_loss"] < 5.5  # below ln(256): it learnt
