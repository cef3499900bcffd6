"""`dtorch plan` end to end: output, JSON document, bad input, no torch import."""

import json
import subprocess
import sys

import pytest

from dtorch.cli import main
from dtorch.plan.plan import Plan

BASE = ["plan", "--model", "llama3-70b", "--cluster", "h100:8x8", "--seq-len", "8192", "--global-batch", "512"]


def test_plan_prints_ranked_table_and_explanation(capsys):
    assert main(BASE) == 0
    out = capsys.readouterr().out
    assert "tok/s/GPU" in out and "chosen:" in out and "why not the other families" in out


def test_an_image_model_is_planned_in_samples_and_small_units(capsys, monkeypatch):
    """A user's CNN: its batch counts samples, not tokens; a 2K-parameter model is not '0.0B'; a
    millisecond step is not '0.00 s'."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    assert main(["plan", "--model", "_user_cnn:cnn", "--cluster", "cpu:1x4", "--global-batch", "64"]) == 0
    out = capsys.readouterr().out
    head, _, rest = out.partition("chosen:")
    assert "(2.1K params)" in head and "global batch 64 (samples/step)" in head and "samples/s/GPU" in head
    assert "tokens" not in head and " 0.00 " not in out and "+0.00 s" not in out
    assert " samples/s (" in rest and "samples/s/GPU" in rest


def test_json_is_the_plan_document_with_predictions(capsys, tmp_path):
    out_file = tmp_path / "plan.yaml"
    assert main([*BASE, "--json", "--top", "2", "--out", str(out_file)]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "microbatch_size", "num_microbatches", "schedule",
                "ac", "offload"):
        assert key in doc
    pred = doc["predicted"]
    for key in ("step_time_s", "tokens_per_s", "mfu", "memory_bytes_per_rank", "memory_breakdown"):
        assert key in pred
    assert doc["dp_replicate"] * doc["dp_shard"] * doc["cp"] * doc["tp"] * doc["pp"] == 64
    saved = Plan.load(out_file)
    assert saved.tp == doc["tp"] and saved.predicted["mfu"] == pytest.approx(pred["mfu"])


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--fix", "tp=3"], "tp=3"),
        (["--fix", "pp=81"], "pp=81"),
        (["--fix", "tp=8,pp=2,dp_shard=2,cp=1,dp_replicate=1"], "world size is 64"),
        (["--cluster", "v100:8x8"], "unknown device preset"),
        (["--global-batch", "0"], "global-batch=0"),
        (["--steps", "0"], "steps=0"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, extra, needle):
    args = list(BASE)
    if extra[0] == "--cluster":
        args[args.index("--cluster") + 1] = extra[1]
    else:
        args += extra
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err


def test_malformed_cluster_file_is_one_line_exit_2(capsys, tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("groups:\n  - device: h100\n    num_nodes: lots\n")
    args = list(BASE)
    args[args.index("--cluster") + 1] = str(bad)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "groups[0].num_nodes" in err and len(err.splitlines()) == 1


def test_unknown_model_is_one_line_exit_2(capsys):
    args = list(BASE)
    args[args.index("--model") + 1] = "llama9-1t"
    assert main(args) == 2
    assert "llama9-1t" in capsys.readouterr().err


def test_recommend_sizes_a_cluster(capsys):
    rc = main(["plan", "--model", "llama3-8b", "--seq-len", "4096", "--global-batch", "256", "--recommend",
               "--device-type", "h100", "--tokens", "100B", "--deadline", "7d", "--max-nodes", "8"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and "GPU-hours" in out


def test_plan_command_does_not_import_torch():
    code = ("import sys; from dtorch.cli import main; "
            f"rc = main({BASE!r} + ['--json']); assert rc == 0; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_verify_measures_model_state_beside_the_estimate(capsys):
    args = ["plan", "--model", "llama3-1b", "--cluster", "h100:1x8", "--seq-len", "2048", "--global-batch", "16",
            "--fix", "tp=2,pp=2", "--verify", "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert abs(doc["verify"]["relative_error"]) < 0.03
