"""Context parallelism: every cp rank holds a slice of each sample's sequence; attention sees all keys.

The sharding is Llama 3's (Grattafiori et al. 2024, section 3.3.2):

- The sequence of each sample is cut into 2*cp equal chunks; cp rank r holds chunks r and
  2*cp-1-r. Under a causal mask a late chunk attends to more keys than an early one, so pairing
  an early with a late chunk gives every rank the same attention work. Inputs and labels are
  sharded the same way (`ContextParallel.shard`), by `ParallelModel` before the forward (before
  the pipeline schedule under pp: every stage runs on the local tokens).
- The model's own code sees only local tokens. Two hooks that the reference models declare (and
  leave None when nothing is installed) give it the rest: `token_positions` returns the global
  positions of the local tokens (RoPE tables and GPT's learned position embedding are indexed by
  them) and every attention module's `core_attention` replaces its causal SDPA.
- A MoE's sequence-wise balance loss needs whole sequences: `MoE.sequence_all_reduce` sums each
  sequence's per-expert counts and mean scores over the cp ranks (one small all-reduce per MoE
  block), and the gradient flows through the local scores' mean, averaged over cp like the LM loss.
- Parameters are replicated across cp ranks and each rank's loss covers only its tokens, so the
  gradients are averaged over the cp axis too: FSDP shards over dp_shard x cp flattened
  (torchtitan's ``dp_shard_cp``; see mesh.py `fsdp_mesh`). Each rank's loss is the mean over its
  tokens; with the same number of counted tokens on every rank (no ignored labels), the mean over
  ranks is the mean over all tokens of the global batch.

Two attentions, the plan's `cp_attention` (the planner prices both, strategies/context.py):

- ``allgather``: K and V (after RoPE, the key/value heads before any grouped-query repetition)
  all-gathered over the cp axis in ONE autograd-aware collective, whose backward reduce-scatters
  the K/V gradients to their owners; SDPA with a boolean mask built from the global positions of
  the local queries and of all keys (kept in rank order: only the mask must match). One collective
  per layer, exposed, and all keys of the sequence held at once (small under GQA: Llama 3's
  argument). On CUDA an explicit mask rules out the flash kernel.
- ``ring``: K/V blocks passed around the cp ring (Liu et al. 2023, ring attention), each step's
  block attended with a kernel that returns its log-sum-exp, the partial outputs merged by online
  softmax (`_RingAttention`). The send of the next block is posted before the current block's
  attention, so the transfer hides behind it; backward passes the K/V blocks round again with their
  gradient accumulators, which end at their owners. The load-balanced chunks give the causal mask
  three cheap cases per step (torch's `_templated_ring_attention` note): the own block is causal,
  a block from a lower rank is attended by all local queries to its first chunk only, a block from
  a higher rank by the local second chunk only. Nothing larger than one block is held.

Why not torch's own: torch 2.13's experimental `context_parallel` runs ring attention by
intercepting the CUDA-only flash / efficient / cuDNN SDPA ops and has no sharding rule for the CPU
op ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered"); its `_templated_ring_attention` rotates with an all-to-all over the whole
group and reads process-wide options. Ours is point-to-point (batched isend/irecv between ring
neighbours) on any backend; the block kernel is the CPU flash op on CPU, on CUDA the flash op for
16-bit blocks (called as torch's ring calls it) and otherwise an explicit float32 softmax (correct
on any device, slow). The CUDA paths have not been run: no GPU was at hand.

Not supported: models that do not declare the two hooks (e.g. transformers models), see `check_cp`
(ConfigError before any process group). Attention dropout (GPT's dropout > 0 in training) runs
the all-gather attention whatever the plan says (warned once): the ring's block kernels draw no
consistent masks. With ignored labels (-100) the ranks' token counts differ and each rank's mean
weighs equally, as data-parallel ranks and micro-batches already do.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from dtorch.errors import ConfigError
from dtorch.model.structure import CONTEXT_ATTENTION_HOOK, CONTEXT_POSITIONS_HOOK, context_hooks_reason
from dtorch.parallel.halves import Half, Meshes
from dtorch.parallel.mesh import sub_mesh
from dtorch.plan.plan import Plan

POSITIONS_HOOK = CONTEXT_POSITIONS_HOOK
"""Model attribute: None, or a callable local_len, device -> (global positions LongTensor[local_len],
global sequence length)."""
ATTENTION_HOOK = CONTEXT_ATTENTION_HOOK
"""Attention-module attribute: None, or a callable (q, k, v, *, dropout_p, enable_gqa) -> output,
q/k/v [batch, heads, local_len, head_dim], replacing causal SDPA over the local sequence."""
SEQUENCE_REDUCE_HOOK = "sequence_all_reduce"
"""Module attribute (dtorch.models.moe.MoE): None, or a callable(tensor) summing it in place over the
cp ranks, for statistics of whole sequences (the sequence-wise balance loss)."""


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if ATTENTION_HOOK in dir(type(m))]


def check_cp(plan: Plan, model: nn.Module) -> None:
    """Raise ConfigError if `plan.cp > 1` and `model` does not declare the context-parallel hooks
    (`dtorch.model.structure.context_hooks_reason`, the planner's rule too)."""
    if plan.cp == 1:
        return
    if why := context_hooks_reason(model):
        raise ConfigError("cp", plan.cp, f"{why}; use cp=1 and put the degree into dp_shard or tp")


def shard_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens cp rank `rank` holds, in its local order: chunks rank and
    2*cp-1-rank of 2*cp equal chunks (load balancing for the causal mask). LongTensor[seq_len/cp]."""
    assert seq_len % (2 * cp) == 0, (seq_len, cp)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in (rank, 2 * cp - 1 - rank)])


# ---- ring attention ------------------------------------------------------------------------------
def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T scale) v, its log-sum-exp over the keys [b, h, s_q], float32 (float64 for
    float64 inputs)) for one block;
    k/v have q's head count. `causal`: top-left causal mask (q and k cover the same positions)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.to(_acc(q))
    if _cuda_flash(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse.float()
    return math_block_attention(q, k, v, causal, scale)


def block_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one block's share of an attention whose merged output is `out` and
    log-sum-exp `lse` (over ALL keys): the probabilities are exp(q k^T scale - lse)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.to(_acc(q)), 0.0, causal, scale=scale)
    if _cuda_flash(q):
        # the dense (not variable-length) kernel: no cumulative lengths; no dropout, so no RNG state
        none = torch.empty(0, device=q.device, dtype=torch.int64)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), none, none, q.shape[2], k.shape[2], 0.0, causal,
            none, none, scale=scale)
    return math_block_attention_backward(dout, q, k, v, out, lse, causal, scale)


def _cuda_flash(q: torch.Tensor) -> bool:
    """Whether the CUDA flash kernel takes this block (16-bit, head dim a multiple of 8 up to 256),
    as torch's own ring attention calls it; otherwise the explicit float32 path."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def _acc(t: torch.Tensor) -> torch.dtype:
    """The dtype partial results are merged and accumulated in."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    acc = _acc(q)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def math_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_attention` in explicit float32 (float64) operations, on any device."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.to(s.dtype)).to(q.dtype), lse


def math_block_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  out: torch.Tensor, lse: torch.Tensor, causal: bool,
                                  scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`block_attention_backward` in explicit float32 (float64) operations, on any device."""
    p = torch.exp(_scores(q, k, causal, scale) - lse[..., None])
    acc = p.dtype
    df = dout.to(acc)
    dv = torch.matmul(p.transpose(-1, -2), df)
    ds = p * (torch.matmul(df, v.to(acc).transpose(-1, -2)) - (df * out.to(acc)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.to(acc)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _Ring:
    """Point-to-point rotation over the cp group: post a send to the next rank and a receive from
    the previous one, wait later (the transfer overlaps the work in between)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.group, self.size = group, size
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def post(self, t: torch.Tensor, tag: int) -> tuple[torch.Tensor, list, torch.Tensor]:
        buf = torch.empty_like(t)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, self.next, self.group, tag),
                                       dist.P2POp(dist.irecv, buf, self.prev, self.group, tag)])
        return buf, reqs, t  # (the sent tensor stays referenced until the wait)

    @staticmethod
    def wait(posted: tuple[torch.Tensor, list, torch.Tensor]) -> torch.Tensor:
        buf, reqs, _ = posted
        for r in reqs:
            r.wait()
        return buf


def _step_case(i: int, rank: int) -> str:
    """Which part of step i's block rank attends to (module doc): 'own' (causal), 'low' (a lower
    rank's block: its first chunk, all local queries), 'high' (a higher rank's block: all of it,
    the local second chunk only)."""
    return "own" if i == 0 else "low" if i <= rank else "high"


def _expand(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _fold(t: torch.Tensor, rep: int) -> torch.Tensor:
    """Gradient of `_expand`: sum the query heads that shared a key/value head."""
    if rep == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // rep, rep, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    """Causal ring attention over load-balanced chunks (module doc). q [b, h, s, d], k/v
    [b, kv_heads, s, d] (h a multiple of kv_heads) -> [b, h, s, d]."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, rank: int):
        rep, half, scale = q.shape[1] // k.shape[1], q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
        q = q.contiguous()
        kv = torch.stack((k, v)).contiguous()
        out = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=_acc(q), device=q.device)
        for i in range(ring.size):
            posted = ring.post(kv, 1) if i < ring.size - 1 else None  # the next block travels meanwhile
            case = _step_case(i, rank)
            bk, bv = _expand(kv[0], rep), _expand(kv[1], rep)
            rows = slice(half, None) if case == "high" else slice(None)
            if case == "low":
                bk, bv = bk[:, :, :half], bv[:, :, :half]
            o_b, l_b = block_attention(q[:, :, rows].contiguous(), bk.contiguous(), bv.contiguous(),
                                       case == "own", scale)
            # online softmax: merge the block's normalised output by its share of the total mass
            l_new = torch.logaddexp(lse[:, :, rows], l_b)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - l_new)[..., None]
                               + o_b.to(out.dtype) * torch.exp(l_b - l_new)[..., None])
            lse[:, :, rows] = l_new
            if posted is not None:
                kv = _Ring.wait(posted)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.rank = ring, rank
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, rank = ctx.ring, ctx.rank
        rep, half, scale = q.shape[1] // k.shape[1], q.shape[2] // 2, 1.0 / math.sqrt(q.shape[-1])
        dout = dout.contiguous()
        kv = torch.stack((k, v)).contiguous()
        acc = _acc(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv_posted = None
        for i in range(ring.size):
            posted = ring.post(kv, 1) if i < ring.size - 1 else None
            case = _step_case(i, rank)
            bk, bv = _expand(kv[0], rep), _expand(kv[1], rep)
            rows = slice(half, None) if case == "high" else slice(None)
            keys = slice(None, half) if case == "low" else slice(None)
            gq, gk, gv = block_attention_backward(
                dout[:, :, rows].contiguous(), q[:, :, rows].contiguous(), bk[:, :, keys].contiguous(),
                bv[:, :, keys].contiguous(), out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(),
                case == "own", scale)
            dq[:, :, rows] += gq.to(acc)
            # the block's gradient accumulator travels one step behind it and ends at its owner
            dkv = (torch.zeros((2, *k.shape), dtype=acc, device=k.device) if dkv_posted is None
                   else _Ring.wait(dkv_posted))
            dkv[0][:, :, keys] += _fold(gk.to(acc), rep)
            dkv[1][:, :, keys] += _fold(gv.to(acc), rep)
            dkv_posted = ring.post(dkv, 2)
            if posted is not None:
                kv = _Ring.wait(posted)
        dkv = _Ring.wait(dkv_posted)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


# ---- this rank's view ----------------------------------------------------------------------------
class ContextParallel:
    """This rank's view of the cp mesh axis: the sequence shard it holds and the attention over
    the whole sequence (`method`: the plan's `cp_attention`). Plain object (not an nn.Module): it
    holds no state worth checkpointing."""

    def __init__(self, cp_mesh: DeviceMesh, method: str = "allgather"):
        assert cp_mesh.ndim == 1, cp_mesh
        assert method in ("allgather", "ring"), method
        self.mesh = cp_mesh
        self.method = method
        self.size = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
        self._ring = _Ring(cp_mesh.get_group(), self.rank, self.size) if method == "ring" else None
        self._warned = False
        self._tables_cache: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of `t` along the sequence dim `dim`, in the order of `shard_positions`."""
        n = t.shape[dim]
        if n % (2 * self.size):
            raise ConfigError("seq_len", n, f"context parallel splits the sequence into 2*cp = {2 * self.size} "
                              f"load-balanced chunks; use a multiple of {2 * self.size}")
        return t.index_select(dim, shard_positions(n, self.size, self.rank).to(t.device))

    def _tables(self, local_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(This rank's global positions [local_len]; its causal mask [local_len, cp * local_len]
        against the keys of all ranks in rank order, True where a query may attend to a key)."""
        key = (local_len, device)
        if key not in self._tables_cache:
            seq = local_len * self.size
            keys = torch.cat([shard_positions(seq, self.size, r) for r in range(self.size)])
            mine = shard_positions(seq, self.size, self.rank)
            self._tables_cache[key] = (mine.to(device), (keys[None, :] <= mine[:, None]).to(device))
        return self._tables_cache[key]

    def positions(self, local_len: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """(Global positions of this rank's `local_len` tokens, global sequence length)."""
        return self._tables(local_len, device)[0], local_len * self.size

    def sequence_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` in place over the cp ranks (no autograd: statistics only)."""
        dist.all_reduce(t, group=self.mesh.get_group())
        return t

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
                  enable_gqa: bool = False) -> torch.Tensor:
        """Causal attention of the local queries to the keys of the whole sequence.
        q [b, heads, local_len, d], k/v [b, kv_heads, local_len, d] -> [b, heads, local_len, d]."""
        if self._ring is not None:
            if dropout_p == 0.0:
                return _RingAttention.apply(q, k, v, self._ring, self.rank)
            if not self._warned:
                self._warned = True
                warnings.warn("cp_attention=ring: attention dropout runs the all-gather attention instead "
                              "(the ring's block kernels draw no consistent dropout masks)", stacklevel=2)
        return self._gathered(q, k, v, dropout_p=dropout_p, enable_gqa=enable_gqa)

    def _gathered(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float,
                  enable_gqa: bool) -> torch.Tensor:
        b, h, s, d = k.shape
        # K and V in one collective (one latency per layer); its backward reduce-scatters the
        # gradients of every rank's queries back to the ranks that own the keys.
        kv = all_gather_single_autograd(torch.stack((k, v)).contiguous(), gather_dim=0, group=self.mesh)
        kv = kv.view(self.size, 2, b, h, s, d).permute(1, 2, 3, 0, 4, 5).reshape(2, b, h, self.size * s, d)
        _, mask = self._tables(s, q.device)
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, dropout_p=dropout_p,
                                              enable_gqa=enable_gqa)


def _install(part: nn.Module, cp: ContextParallel) -> None:
    setattr(part, POSITIONS_HOOK, cp.positions)
    for mod in _attention_modules(part):
        setattr(mod, ATTENTION_HOOK, cp.attention)
    for mod in part.modules():  # a MoE's sequence-wise balance loss needs the whole sequence's statistics
        if hasattr(type(mod), SEQUENCE_REDUCE_HOOK):
            setattr(mod, SEQUENCE_REDUCE_HOOK, cp.sequence_all_reduce)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, method: str = "allgather") -> ContextParallel:
    """Install the context-parallel hooks on `model` (a whole model or one pipeline stage of it,
    checked by `check_cp`)."""
    cp = ContextParallel(cp_mesh, method)
    _install(model, cp)
    return cp


# ---- the executor half (dtorch.parallel.halves) ---------------------------------------------------
def _apply(part: nn.Module, meshes: Meshes, plan: Plan) -> None:
    if plan.cp > 1:  # every pipeline stage this rank runs: each gets the hooks, one view serves them all
        if meshes.context is None:
            meshes.context = ContextParallel(sub_mesh(meshes.mesh, "cp"), plan.cp_attention)
        _install(part, meshes.context)


HALVES = (Half(20, apply=_apply, check=lambda model, plan, device_type: check_cp(plan, model)),)
