"""Dropout's RNG rule in one process (dtorch/parallel/rng.py); the multi-process cases are in
test_loss_equivalence.py.

- Activation checkpointing recomputes with the forward's RNG state: with dropout 0.1 the gradients
  under ac=full and ac=selective equal those of the unmodified model.
- A one-rank plan draws exactly what a plain single-device run seeded with the plan's seed draws.
- The seed rule: TP ranks share a stream, every other mesh position gets its own.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _training  # noqa: E402

from dtorch.models import build_model  # noqa: E402
from dtorch.parallel.ac import apply_ac  # noqa: E402
from dtorch.parallel.materialize import init_model  # noqa: E402
from dtorch.parallel.rng import rank_seed  # noqa: E402
from dtorch.plan.plan import Plan  # noqa: E402
from dtorch.train.losses import next_token  # noqa: E402

DROPOUT = "gpt-tiny:dropout=0.1"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is 20-40x faster than many on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _grads(model: torch.nn.Module, dropout_seed: int) -> torch.Tensor:
    x, y = _training.batch(0, 4)
    torch.manual_seed(dropout_seed)
    next_token(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_activation_checkpointing_recomputes_with_the_forwards_dropout_masks(policy: str) -> None:
    model = build_model(DROPOUT)
    init_model(model, 0)
    reference = _grads(copy.deepcopy(model), dropout_seed=7)
    # the test can fail: other masks give other gradients (tens of percent apart)
    assert _rel(_grads(copy.deepcopy(model), dropout_seed=8), reference) > 0.05
    checkpointed = copy.deepcopy(model)
    apply_ac(checkpointed, policy)
    assert sum("CheckpointWrapper" in type(m).__name__ for m in checkpointed.modules()) == 4
    assert _rel(_grads(checkpointed, dropout_seed=7), reference) <= 1e-5


def test_one_rank_plan_draws_the_masks_of_a_plain_run_with_its_seed() -> None:
    from dtorch.parallel import parallelize

    pm = parallelize(lambda: build_model(DROPOUT), Plan(microbatch_size=8), loss_fn=next_token, seed=3,
                     seq_len=_training.SEQ)
    x, y = _training.batch(0, 8)
    loss = float(pm.forward_backward(x, y))  # first: nothing else may draw in between
    ref = build_model(DROPOUT)
    init_model(ref, 3)  # the weights parallelize gives seed 3
    torch.manual_seed(3)
    expected = float(next_token(ref(x), y))
    assert loss == pytest.approx(expected, rel=1e-6)
    torch.manual_seed(4)
    assert float(next_token(ref(x), y)) != pytest.approx(expected, rel=1e-6)  # other masks, other loss


def test_seed_rule_shares_a_stream_over_tp_only() -> None:
    plan = Plan(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2)
    seeds = {}
    for pp in range(2):
        for dr in range(2):
            for ds in range(2):
                for cp in range(2):
                    for tp in range(2):
                        coord = dict(pp=pp, dp_replicate=dr, dp_shard=ds, cp=cp, tp=tp)
                        seeds[(pp, dr, ds, cp, tp)] = rank_seed(5, plan, coord)
    assert seeds[(0, 0, 0, 0, 0)] == 5
    for key, s in seeds.items():
        assert s == seeds[(*key[:4], 0)]  # TP ranks share
    assert len(set(seeds.values())) == 16  # every other position differs


def test_attention_core_draws_from_the_tp_shards_stream_and_keeps_the_shared_one_in_step() -> None:
    from dtorch.parallel.rng import _attention_on_shard_stream

    q = k = v = torch.randn(2, 4, 8, 16)
    outs, states = [], []
    for tp_rank in (0, 1, 0):
        holder = torch.nn.Module()
        holder._dtorch_saved_rng = []
        torch.manual_seed(11)  # the shared stream, the same on every TP rank
        outs.append(_attention_on_shard_stream(q, k, v, dropout_p=0.5, holder=holder, tp_rank=tp_rank))
        states.append(torch.get_rng_state())
    assert not torch.equal(outs[0], outs[1])  # other heads, other masks
    assert torch.equal(outs[0], outs[2])  # a recompute draws the same
    assert torch.equal(states[0], states[1])  # the shared stream advanced alike on both ranks
