"""Context parallelism's two attentions (all-gather, ring) and context parallelism under a pipeline.

- The attention core alone, on real gloo groups of 2 and 4: a sequence sharded as the executor
  shards it gives, forward and backward, what causal SDPA gives on the whole sequence (with
  grouped-query heads), and NOT what attention without the mask gives (the check would see a lost
  mask).
- Training: 5 AdamW steps in float32 under each plan give per-step losses within 1e-5 relative of
  one process training on the same global batch (tests/parallel/_training.py): ring CP at world 2
  (and with full activation checkpointing, whose recompute runs the ring again), CP x PP at world 4
  (cp=2, pp=2: all-gather with 1F1B on Llama, ring with interleaved 1F1B on GPT and with zero-bubble
  on Llama) and ring CP at cp=4.
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _training  # noqa: E402
from _harness import run_group  # noqa: E402

from dtorch.plan.plan import Plan  # noqa: E402

REL = 1e-5

CASES_2 = {
    "ring": dict(cp=2, cp_attention="ring", microbatch_size=4),
    "ring_ac_full": dict(cp=2, cp_attention="ring", ac="full", microbatch_size=2, num_microbatches=2),
}
CASES_4 = {
    "cp_x_pp": dict(cp=2, pp=2, schedule="1f1b", num_microbatches=2, microbatch_size=2),
    "gpt_ring_cp_x_pp_interleaved": dict(model="gpt-tiny", cp=2, pp=2, cp_attention="ring", virtual_stages=2,
                                         schedule="interleaved_1f1b", num_microbatches=2, microbatch_size=2),
    "ring_cp4": dict(cp=4, cp_attention="ring", microbatch_size=4),
    "ring_cp_x_tp_sp": dict(cp=2, tp=2, sp=True, cp_attention="ring", microbatch_size=4),
    # zero-bubble's split backward under FSDP (cp > 1 shards over cp) needs the stage kept gathered
    "ring_cp_x_pp_zero_bubble": dict(cp=2, pp=2, cp_attention="ring", schedule="zero_bubble", num_microbatches=2,
                                     microbatch_size=2, reshard_after_forward=False),
}
ATTENTION = [("allgather", 2), ("ring", 2), ("allgather", 4), ("ring", 4), ("ring-bfloat16", 2)]
"""(cp_attention[-dtype], cp) cases of the attention core alone, run in the same groups as the
training; float64 unless named (bfloat16: the CPU kernel's other path, merged in float32)."""


def _worker(case: tuple, rank: int) -> dict:
    kind, args = case
    return _attention_worker(args, rank) if kind == "attention" else _training.parallel(args, rank)


@pytest.fixture(scope="module")
def runs() -> dict:
    """Every case in one group of 2 and one of 4 gloo processes (the groups are the slow part)."""
    out = {}
    for world, cases in ((2, CASES_2), (4, CASES_4)):
        keyed = {**{("attention", a): ("attention", a) for a in ATTENTION if a[1] == world},
                 **{name: ("train", kw) for name, kw in cases.items()}}
        out.update(zip(keyed, run_group(world, list(keyed.values()), _worker)))
    return out


# ---- the attention core ------------------------------------------------------------------------
def _attention_worker(case: tuple[str, int], rank: int) -> dict:
    """The cp group's attention on its shard vs causal SDPA on the whole sequence (every rank
    computes the reference from the same seed)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from dtorch.parallel.cp import ContextParallel

    method, cp = case
    method, _, low = method.partition("-")
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(7)
    b, h, kvh, s, d = 2, 4, 2, 8 * cp, 8
    q, k, v = (torch.randn(b, n, s, d, generator=g, dtype=torch.float64) for n in (h, kvh, kvh))
    dy = torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    ctx = ContextParallel(mesh, method)
    dtype = getattr(torch, low) if low else torch.float64
    ql, kl, vl = (ctx.shard(t, dim=2).to(dtype).requires_grad_() for t in (q, k, v))
    out = ctx.attention(ql, kl, vl, enable_gqa=True)
    out.backward(ctx.shard(dy, dim=2).to(dtype))
    full = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    ref.backward(dy)
    unmasked = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def err(a, b):
        return float((a.double() - b).detach().abs().max())

    return {"out": err(out, ctx.shard(ref, dim=2)), "dq": err(ql.grad, ctx.shard(full[0].grad, dim=2)),
            "dk": err(kl.grad, ctx.shard(full[1].grad, dim=2)), "dv": err(vl.grad, ctx.shard(full[2].grad, dim=2)),
            "vs_unmasked": err(out, ctx.shard(unmasked, dim=2))}


@pytest.mark.slow
@pytest.mark.parametrize("method,cp", ATTENTION)
def test_sharded_attention_equals_causal_attention_on_the_whole_sequence(runs: dict, method: str, cp: int) -> None:
    tol = 5e-2 if "bfloat16" in method else 1e-10  # bfloat16: 8 bits of mantissa on values of order 1
    for r, res in enumerate(runs[("attention", (method, cp))]):
        assert "error" not in res, f"{method} rank {r}:\n{res['error']}"
        assert max(res[k] for k in ("out", "dq", "dk", "dv")) < tol, (method, r, res)
        # without the causal mask the output would differ by order 1: the check above sees a lost mask
        assert res["vs_unmasked"] > 1e-2, (method, r, res)


def test_math_block_kernel_equals_the_cpu_flash_kernel() -> None:
    """The ring's block kernel off the CPU (explicit float32) against the CPU flash op it uses here:
    output, log-sum-exp and gradients, causal and not."""
    from dtorch.parallel import cp

    g = torch.Generator().manual_seed(3)
    q, k, v, dy = (torch.randn(2, 3, 6, 8, generator=g) for _ in range(4))
    for causal in (True, False):
        o1, l1 = cp.block_attention(q, k, v, causal, 0.3)
        o2, l2 = cp.math_block_attention(q, k, v, causal, 0.3)
        torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
        for a, b in zip(cp.block_attention_backward(dy, q, k, v, o1, l1, causal, 0.3),
                        cp.math_block_attention_backward(dy, q, k, v, o1, l1, causal, 0.3)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---- training ----------------------------------------------------------------------------------
@cache
def _reference(global_batch: int, model_name: str) -> dict:
    return _training.single_process(global_batch, model_name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*CASES_2, *CASES_4])
def test_context_parallel_plans_match_single_process_losses_within_1e_5(runs: dict, name: str) -> None:
    kwargs = dict({**CASES_2, **CASES_4}[name])
    per_rank = runs[name]
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    model_name = kwargs.pop("model", "llama-tiny")
    plan = Plan(**kwargs)
    ref = _reference(plan.dp * plan.local_batch(), model_name)
    worst = max(abs(a - b) / abs(b) for res in per_rank for a, b in zip(res["losses"], ref["losses"]))
    print(f"{name}: largest relative loss difference {worst:.2e}")
    assert worst <= REL, name
    assert set().union(*(res["keys"] for res in per_rank)) == set(ref["keys"])
