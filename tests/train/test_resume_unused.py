"""A model whose branch no step has taken yet resumes from its checkpoint exactly.

A parameter that has never had a gradient has no optimizer state; the checkpoint must still hold
every key a resume's template asks for, without changing what the optimizer computes."""

from __future__ import annotations

import pytest


def test_a_branch_not_taken_before_the_checkpoint_resumes_bit_identical(tmp_path) -> None:
    from benchmarks import zoo
    from dtorch.train.optim import Constant
    from dtorch.train.trainer import Trainer

    (case,) = [c for c in zoo.cases() if c.name == "branchy"]

    def trainer(ckpt):
        return Trainer(model=case.factory, data=case.dataset(), loss=case.loss, global_batch=8,
                       checkpoint_dir=ckpt, checkpoint_every=2, lr_schedule=Constant(), console=False,
                       straggler_every=0, metrics_every=0, async_checkpoint=False)

    straight = trainer(None).fit(4).losses
    assert trainer(tmp_path / "a").fit(2).losses == {s: straight[s] for s in (1, 2)}
    resumed = trainer(tmp_path / "a").fit(4)
    assert resumed.resumed_from == 2
    assert resumed.losses == pytest.approx({s: straight[s] for s in (3, 4)}, rel=0, abs=0)
