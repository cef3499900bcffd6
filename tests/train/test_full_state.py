"""`Trainer.full_state_dict()`: the whole model on rank 0 under every plan (the sample text at the
end of `dtorch train` and exports read it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SPEC = "gpt:layers=2,hidden=64,heads=2,vocab=256,seq=32"


def _worker(plan: dict, rank: int) -> list[str] | None:
    from functools import partial

    import torch

    from dtorch.models import build_model
    from dtorch.train.trainer import Trainer

    data = [torch.randint(0, 256, (33,), generator=torch.Generator().manual_seed(i)) for i in range(16)]
    trainer = Trainer(model=partial(build_model, SPEC), data=data, global_batch=4, seq_len=32, plan=plan,
                      console=False, straggler_every=0, metrics_every=0)
    trainer.fit(1)
    full = trainer.full_state_dict()
    return sorted(full) if full is not None else None


@pytest.mark.slow
@pytest.mark.parametrize("plan", [{"pp": 2}, {"dp_shard": 2}])
def test_rank_0_gets_every_weight_of_the_model(plan: dict) -> None:
    from dtorch.models import build_model

    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
    from _harness import run_group

    (r0, r1), = run_group(2, [plan], _worker)
    assert r0 == sorted(build_model(SPEC).state_dict()) and r1 is None
