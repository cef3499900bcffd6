"""Tied weights at world 4, the plans test_tied.py cannot reach at world 2: FSDP x PP, TP x PP and
TP+SP x PP of transformers' GPT2LMHeadModel (default tie), 5 AdamW steps against the plain loop.

    python benchmarks/tied_world4.py     # about 1 minute on 2 CPU cores

Prints, per plan and rank, the largest per-step loss difference relative to the plain loop and the
tied weight's fingerprint under each name this rank holds (equal on every rank when the tie holds),
after training and after a DCP save and reload.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "parallel"))
import _tied  # noqa: E402
from _harness import run_group  # noqa: E402

from dtorch.plan.plan import Plan  # noqa: E402

CASES = {
    "fsdp_x_pp": dict(dp_shard=2, pp=2, schedule="1f1b", num_microbatches=2, microbatch_size=1),
    "tp_x_pp": dict(tp=2, pp=2, schedule="1f1b", num_microbatches=2, microbatch_size=2),
    "tp_sp_x_pp": dict(tp=2, sp=True, pp=2, schedule="gpipe", num_microbatches=2, microbatch_size=2),
}


def main() -> None:
    ckpt = tempfile.mkdtemp()
    cases = [(k, {"model": "hf-gpt2", "plan": v, "ckpt": ckpt}) for k, v in CASES.items()]
    for (name, spec), per_rank in zip(cases, run_group(4, cases, _tied.worker)):
        plan = Plan(**spec["plan"])
        ref = _tied.plain_loop("hf-gpt2", plan.dp * plan.local_batch())["losses"]
        for rank, res in enumerate(per_rank):
            if "error" in res:
                print(name, rank, res["error"])
                continue
            rel = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref))
            print(f"{name} rank {rank}: max rel loss diff {rel:.2e}  trained {json.dumps(res['trained']['prints'])}"
                  f"  reloaded {json.dumps(res['loaded']['prints'])}")


if __name__ == "__main__":
    main()
