"""--trace-comms on a real 2-worker tensor-parallel run: every rank's collectives are recorded per
step with a per-module summary, the two sequences agree; a rank whose sequence departs (the
recorded file of rank 1 cut or changed, as a hang leaves it) is named with its peer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dtorch.monitor.comms import describe_mismatch, find_mismatch
from dtorch.monitor.report import read_jsonl

pytestmark = pytest.mark.slow


def test_trace_comms_records_every_rank_and_names_a_departing_rank(tmp_path, capsys):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "dtorch.cli", "train", "--nproc", "2", "--model",
           "gpt:layers=2,hidden=64,heads=2,vocab=256,seq=64", "--seq-len", "64", "--global-batch", "4",
           "--steps", "3", "--checkpoint-dir", str(run), "--checkpoint-every", "100", "--sample-tokens", "0",
           "--plan", "tp=2", "--trace-comms", "--metrics-every", "0", "--no-progress", "--max-restarts", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    traces = {r: read_jsonl(run / f"comms-rank{r}.jsonl") for r in (0, 1)}
    for recs in traces.values():
        summaries = [x for x in recs if "summary" in x]
        assert [x["step"] for x in summaries] == [1, 2, 3]
        assert all(x["summary"] and x["calls"] > 0 for x in summaries)
        assert all(k.endswith("/tp") for x in summaries for k in x["summary"])
        # DTensor's functional collectives are in the ordered sequence by name, with their time
        last = summaries[-1]["summary"]
        assert last["all_gather_single/tp"]["count"] > 0 and last["reduce_scatter_single/tp"]["bytes"] > 0
        assert last["wait_tensor/tp"]["seconds"] > 0
        # DTensor's collectives per module, from CommDebugMode
        assert any(k.startswith("GPT.layers.0") for k in summaries[-1]["modules"])
    assert find_mismatch(run) is None

    lines = (run / "comms-rank1.jsonl").read_text().splitlines()
    last = max(i for i, x in enumerate(lines) if '"op"' in x and json.loads(x)["step"] == 3)
    cut = lines[:last]  # rank 1 never launched its last collective of step 3
    (run / "comms-rank1.jsonl").write_text("\n".join(cut) + "\n")
    m = find_mismatch(run)
    assert m is not None and (m["rank_a"], m["rank_b"], m["step"]) == (0, 1, 3)
    assert m["call_a"] is not None and m["call_b"] is None
    assert "rank 0 launched all_reduce on tp" in describe_mismatch(m) and "rank 1 launched nothing" in describe_mismatch(m)

    changed = json.loads(lines[last]) | {"op": "all_gather_into_tensor"}
    (run / "comms-rank1.jsonl").write_text("\n".join([*cut, json.dumps(changed)]) + "\n")
    m = find_mismatch(run)
    assert m["call_b"][0] == "all_gather_into_tensor" and m["call_a"][0] == "all_reduce"
    from dtorch.cli import main  # `dtorch report`, in this process: no new interpreter importing torch

    capsys.readouterr()
    code, rep = main(["report", str(run)]), capsys.readouterr()
    assert code == 0 and "collective sequences differ at step 3" in rep.out
    assert "HANG CAUSE" in (run / "report" / "index.html").read_text()
