"""Context parallelism on MoE models with their own sequence-wise balance loss is loss-equivalent to
one process, with and without expert parallelism: 4 gloo ranks, 5 float32 AdamW steps through
`parallelize()`, against one process on the global batch.

Under cp each rank holds two chunks of every sequence; the balance loss needs the whole sequence's
per-expert counts and mean scores, which `MoE.sequence_all_reduce` (installed by
`dtorch.parallel.cp`) sums over the cp ranks. Computed on the local chunk instead, the losses drifted
by 9e-5 and the gradient norms by 1e-3 (moe-tiny, dp_shard=2 x cp=2).

The cases are moe-tiny (softmax scores, 0.01) and mixtral-tiny (0.02) with CP alone and with EP, and
the other EP x CP families the planner offers on cpu:1x4. About 25 s wall on the shared 2-core
machine (one group of 4 processes for all cases).
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _training  # noqa: E402
from _harness import run_group  # noqa: E402

pytestmark = pytest.mark.slow

CASES = {  # each model's own balance loss: moe-tiny 0.01 (softmax), mixtral-tiny 0.02
    "cp": dict(model="moe-tiny", dp_shard=2, cp=2, microbatch_size=4),
    "ep_cp": dict(model="moe-tiny", dp_shard=2, cp=2, ep=2, microbatch_size=4),
    "ep_cp_ring_mixtral": dict(model="mixtral-tiny", dp_shard=2, cp=2, ep=2, microbatch_size=4,
                               cp_attention="ring"),
    # the other EP x CP families the planner offers on cpu:1x4: each pipeline stage's cp ranks,
    # replicas (DDP's averaging), ZeRO-1 with TP and accumulated micro-batches, cp=4
    "pp2_cp2_ep2_zero_bubble": dict(model="moe-tiny", pp=2, cp=2, ep=2, microbatch_size=2, num_microbatches=2,
                                    schedule="zero_bubble", reshard_after_forward=False),
    "ddp2_cp2_ep2_2mb": dict(model="moe-tiny", dp_replicate=2, cp=2, ep=2, microbatch_size=2, num_microbatches=2),
    "cp2_tp2_ep2_zero1_ring": dict(model="moe-tiny", cp=2, tp=2, ep=2, microbatch_size=4, num_microbatches=2,
                                   zero=1, cp_attention="ring"),
    "cp4_ep4_ring": dict(model="moe-tiny", cp=4, ep=4, microbatch_size=8, cp_attention="ring"),
}


def _worker(case: dict, rank: int) -> dict:
    return _training.parallel(case, rank)


@pytest.fixture(scope="module")
def results() -> dict:
    return dict(zip(CASES, run_group(4, list(CASES.values()), _worker)))


@cache
def _reference(model: str, global_batch: int) -> dict:
    return _training.single_process(global_batch, model)


@pytest.mark.parametrize("name", CASES)
def test_cp_on_moe_with_its_balance_loss_matches_one_process(results: dict, name: str) -> None:
    case = CASES[name]
    from dtorch.plan.plan import Plan

    plan = Plan(**{k: v for k, v in case.items() if k != "model"})
    ref = _reference(case["model"], plan.dp * plan.local_batch())
    for r, res in enumerate(results[name]):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=0)
        assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5, abs=0)


def test_the_balance_loss_is_whole_sequence_not_per_chunk() -> None:
    """One process, no collectives: two "cp ranks" each holding half of every sequence, the hook
    adding the other half's statistics. Each rank's value is the whole sequence's, and the mean of
    the two ranks' gradients (what averaging over cp makes of them) is the whole sequence's."""
    import torch

    from dtorch.models import build_model

    torch.manual_seed(0)
    moe = build_model("moe-tiny").moe_modules()[0]
    b, s, E, k = 3, 8, moe.config.n_experts, moe.config.top_k
    scores = torch.randn(b * s, E).softmax(-1)
    idx = scores.topk(k, -1).indices
    leaf = scores.clone().requires_grad_(True)
    whole = moe.balance_loss(leaf, idx, b, s)
    (expect,) = torch.autograd.grad(whole, leaf)

    pos = torch.arange(b)[:, None] * s
    rows = [(pos + torch.arange(s // 2)).reshape(-1), (pos + torch.arange(s // 2, s)).reshape(-1)]

    def other_half(other: torch.Tensor):
        def add(t: torch.Tensor) -> torch.Tensor:  # the all-reduce of two ranks: add the other's
            f = torch.zeros(b, E).scatter_add_(1, idx[other].view(b, -1), torch.ones(b, s // 2 * k))
            return t.add_(torch.stack((f, scores[other].view(b, s // 2, E).mean(1))))
        return add

    mean_grad = torch.zeros(b * s, E)
    try:
        for me, other in ((0, 1), (1, 0)):
            moe.sequence_all_reduce = other_half(rows[other])
            local = scores[rows[me]].clone().requires_grad_(True)
            part = moe.balance_loss(local, idx[rows[me]], b, s // 2)
            assert float(part.detach()) == pytest.approx(float(whole.detach()), rel=1e-6)
            (g,) = torch.autograd.grad(part, local)
            mean_grad[rows[me]] += g / 2
    finally:
        del moe.sequence_all_reduce
    torch.testing.assert_close(mean_grad, expect, rtol=1e-6, atol=1e-10)
    moe.sequence_all_reduce = lambda t: t  # a "cp group" of one: the same as no hook
    try:
        assert float(moe.balance_loss(scores, idx, b, s)) == pytest.approx(float(whole.detach()), rel=1e-6)
    finally:
        del moe.sequence_all_reduce
