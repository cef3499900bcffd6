"""A ZeRO-1 or ZeRO-2 run resumes from its checkpoint exactly (world 2, gloo, one group).

Under ZeRO the parameters are gathered for the whole step and ZeRO-1's gradients accumulate full
size; what a checkpoint holds must still be the sharded parameters and optimizer state, so that a
run stopped at step 2 and resumed gives the losses of a run that never stopped, bit for bit."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _harness import run_group  # noqa: E402


def _worker(case: tuple[int, str], rank: int) -> dict:
    from dtorch.models import build_model
    from dtorch.train.optim import AdamW, Constant
    from dtorch.train.trainer import Trainer

    zero, tmp = case  # (tmp: the same fresh directory on both ranks)

    def trainer(ckpt):
        return Trainer(model=partial(build_model, "llama-tiny"), data=_data(), global_batch=8, seq_len=16,
                       plan={"dp_shard": 2, "zero": zero, "num_microbatches": 2, "param_dtype": "float32",
                             "reduce_dtype": "float32"},
                       optimizer=AdamW(lr=1e-2), lr_schedule=Constant(), checkpoint_dir=ckpt, checkpoint_every=2,
                       console=False, straggler_every=0, metrics_every=0, async_checkpoint=False)

    straight = trainer(None).fit(4)
    first = trainer(tmp).fit(2)
    resumed = trainer(tmp).fit(4)
    return {"straight": straight.losses, "first": first.losses, "resumed": resumed.losses,
            "from": resumed.resumed_from}


def _data():
    import torch

    return [torch.randint(0, 64, (17,), generator=torch.Generator().manual_seed(i)) for i in range(64)]


@pytest.mark.slow
def test_zero_runs_resume_bit_identical(tmp_path) -> None:
    cases = [(1, str(tmp_path / "zero1")), (2, str(tmp_path / "zero2"))]
    for (zero, _), per_rank in zip(cases, run_group(2, cases, _worker)):
        for r, res in enumerate(per_rank):
            assert "error" not in res, f"zero={zero} rank {r}:\n{res['error']}"
        res = per_rank[0]
        straight = {int(k): v for k, v in res["straight"].items()}
        assert {int(k): v for k, v in res["first"].items()} == {s: straight[s] for s in (1, 2)}
        assert res["from"] == 2, res
        assert {int(k): v for k, v in res["resumed"].items()} == {s: straight[s] for s in (3, 4)}, (zero, res)
