"""Golden plans: the ranked top-k the search emits for a fixed set of model x cluster cases, with
their estimates, compared with a file checked in before the strategy registry refactor.

A refactor of the planner must leave every case identical. A change that is meant to move plans
(a new calibration, a new cost term) regenerates the file and shows the difference in review:

    .venv/bin/python tests/plan/test_golden_plans.py --regenerate

The cases use GPU presets and the nominal CPU preset only (no `detect`, no stored calibration, no
capability timing), so the file does not depend on the machine it is checked on. Takes about 3 s.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "data" / "golden_plans.json"
SIG = 6  # significant digits kept of every float

# (name, model, cluster, seq_len, global_batch, fixed)
CASES = [
    ("gpt2-small/h100:1x8", "gpt2-small", "h100:1x8", 1024, 64, None),
    ("gpt2-xl/a100:2x8", "gpt2-xl", "a100:2x8", 1024, 256, None),
    ("llama3-1b/h100:1x8", "llama3-1b", "h100:1x8", 4096, 64, None),
    ("llama3-8b/h100:1x8", "llama3-8b", "h100:1x8", 8192, 64, None),
    ("llama3-8b/h100:1x8/fp32", "llama3-8b", "h100:1x8", 8192, 64, "param_dtype=float32"),
    ("llama3-8b/a100:4x8/bf16-reduce", "llama3-8b", "a100:4x8", 4096, 256, "reduce_dtype=bfloat16"),
    ("llama3-8b/h100:2x8/cp", "llama3-8b", "h100:2x8", 32768, 16, "cp=4"),
    ("llama3-8b/h100:2x8+a100:2x8", "llama3-8b", "h100:2x8+a100:2x8", 4096, 128, None),
    ("llama3-70b/h100:8x8", "llama3-70b", "h100:8x8", 8192, 512, None),
    ("llama3-70b/h100:8x8/fix", "llama3-70b", "h100:8x8", 8192, 512, "tp=8,pp=2,microbatch=1,ac=full"),
    ("llama3-70b/h100:4x8/pp", "llama3-70b", "h100:4x8", 4096, 256, "pp=4,schedule=interleaved"),
    ("llama3-70b/h100:4x8/zb", "llama3-70b", "h100:4x8", 4096, 256, "pp=8,schedule=zero_bubble"),
    ("llama3-70b/h100:2x8/offload", "llama3-70b", "h100:2x8", 4096, 32, "offload=params"),
    ("llama3-405b/h100:16x8", "llama3-405b", "h100:16x8", 8192, 1024, None),
    ("llama3-405b/h200:8x8", "llama3-405b", "h200:8x8", 4096, 256, None),
    ("llama3-405b/h100:1x8/nothing-fits", "llama3-405b", "h100:1x8", 8192, 8, None),
    ("llama-tiny/cpu:4", "llama-tiny", "cpu:4", 256, 8, None),
    ("gpt-tiny/cpu:1x2/fix", "gpt-tiny", "cpu:1x2", 256, 8, "dp_shard=2"),
]

# (name, model, cluster, seq_len, plan fields, estimate keywords): estimates the search never makes
ESTIMATES = [
    ("llama3-8b/h100:1x8/float8-compiled", "llama3-8b", "h100:1x8", 8192,
     {"dp_shard": 8, "param_dtype": "bfloat16", "num_microbatches": 2}, {"dtype": "float8", "compiled": True}),
    ("llama3-70b/h100:8x8/async-tp", "llama3-70b", "h100:8x8", 8192,
     {"dp_shard": 8, "tp": 8, "sp": True, "param_dtype": "bfloat16", "num_microbatches": 8}, {"async_tp": True}),
    ("llama3-70b/h100:8x8/pp-gpipe-cp", "llama3-70b", "h100:8x8", 8192,
     {"pp": 4, "cp": 2, "tp": 8, "sp": True, "schedule": "gpipe", "num_microbatches": 8, "ac": "selective",
      "param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}, {}),
    ("llama3-8b/h100:1x8/ddp-optimizer-offload", "llama3-8b", "h100:1x8", 2048,
     {"dp_replicate": 8, "offload": "optimizer", "param_dtype": "bfloat16", "ac": "full"}, {}),
    ("llama3-8b/h100:1x8/hsdp-noreshard", "llama3-8b", "h100:1x8", 2048,
     {"dp_replicate": 2, "dp_shard": 4, "reshard_after_forward": False, "microbatch_size": 2}, {}),
    ("llama-tiny/cpu:4/tp-pp", "llama-tiny", "cpu:4", 256,
     {"tp": 2, "pp": 2, "sp": True, "num_microbatches": 4, "schedule": "interleaved_1f1b", "virtual_stages": 2}, {}),
]


def _round(x):
    if isinstance(x, float):
        return float(f"{x:.{SIG}g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


def _plan(plan) -> dict:
    d = plan.to_dict()
    d.pop("predicted", None)
    return d


def _est(est) -> dict:
    d = est.to_dict()
    d["notes"] = list(est.notes)
    d["efficiency"] = est.efficiency
    return _round(d)


def _profile(model: str, seq_len: int):
    from dtorch.plan.profiles import get_profile

    return get_profile(model, seq_len)


def _cluster(spec: str):
    from dtorch.cluster.load import parse_shorthand

    return parse_shorthand(spec)  # presets only: nothing measured, nothing stored applied


def run_case(model, cluster, seq_len, global_batch, fixed) -> dict:
    from dtorch.plan.search import parse_fix, search

    r = search(_profile(model, seq_len), _cluster(cluster), global_batch=global_batch, fixed=parse_fix(fixed),
               top_k=5)
    return {
        "ranked": [{"describe": p.describe(), "family": p.family(), "plan": _plan(p), "estimate": _est(e)}
                   for p, e in r.ranked],
        "best_by_family": {fam: {"describe": p.describe(), "step_time_s": _round(e.step_time_s)}
                           for fam, (p, e) in r.best_by_family.items()},
        "best_by_precision": {k: p.describe() for k, (p, _) in r.best_by_precision.items()},
        "rejected": dict(r.rejected),
        "notes": list(r.notes),
        "suggestions": list(r.suggestions),
        "closest": None if r.closest is None else {"describe": r.closest[0].describe(),
                                                   "memory_bytes_per_rank": r.closest[1].memory_bytes_per_rank},
    }


def run_estimate(model, cluster, seq_len, fields, kw) -> dict:
    from dtorch.plan.cost import estimate, step_counts
    from dtorch.plan.plan import Plan

    profile, cl = _profile(model, seq_len), _cluster(cluster)
    rest = cl.world_size
    for axis in ("pp", "dp_replicate", "cp", "tp"):
        rest //= fields.get(axis, 1)
    plan = Plan(**{"dp_shard": rest, **fields})
    counts = step_counts(plan, profile, cl.slowest_group().device.kind)
    return {"describe": plan.describe(), "estimate": _est(estimate(plan, profile, cl, **kw)),
            "step_counts": _round(counts.__dict__)}


def compute() -> dict:
    return {
        "search": {name: run_case(*args) for name, *args in CASES},
        "estimate": {name: run_estimate(*args) for name, *args in ESTIMATES},
    }


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.fixture(autouse=True)
def _no_machine(monkeypatch):
    monkeypatch.setenv("DTORCH_NO_CALIBRATION", "1")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_search_emits_the_golden_plans(case, golden):
    name, *args = case
    assert run_case(*args) == golden["search"][name]


@pytest.mark.parametrize("case", ESTIMATES, ids=[c[0] for c in ESTIMATES])
def test_estimate_is_the_golden_estimate(case, golden):
    name, *args = case
    assert run_estimate(*args) == golden["estimate"][name]


def test_golden_file_covers_every_case(golden):
    assert set(golden["search"]) == {c[0] for c in CASES}
    assert set(golden["estimate"]) == {c[0] for c in ESTIMATES}
    # the cases exercise every strategy family and a case where nothing fits
    fams = {r["family"] for case in golden["search"].values() for r in case["ranked"]}
    assert {"FSDP", "HSDP", "DDP"} & fams and any("TP" in f for f in fams) and any("PP" in f for f in fams)
    assert any("CP" in f for f in fams)
    assert any(not case["ranked"] and case["suggestions"] for case in golden["search"].values())


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/plan/test_golden_plans.py --regenerate")
    os.environ["DTORCH_NO_CALIBRATION"] = "1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(compute(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
