"""Context parallelism: every cp rank holds a slice of each sample's sequence; attention all-gathers K/V.

The form is Llama 3's (Grattafiori et al. 2024, section 3.3.2), not ring attention:

- The sequence of each sample is cut into 2*cp equal chunks; cp rank r holds chunks r and
  2*cp-1-r. Under a causal mask a late chunk attends to more keys than an early one, so pairing
  an early with a late chunk gives every rank the same attention work. Inputs and labels are
  sharded the same way (`ContextParallel.shard`), by `ParallelModel` before the forward.
- The model's own code sees only local tokens. Two hooks that the reference models declare (and
  leave None when nothing is installed) give it the rest: `token_positions` returns the global
  positions of the local tokens (RoPE tables and GPT's learned position embedding are indexed by
  them) and every attention module's `core_attention` replaces its causal SDPA. The installed
  attention all-gathers K and V (after RoPE, the key/value heads before any grouped-query
  repetition) over the cp axis in ONE autograd-aware collective, whose backward reduce-scatters
  the K/V gradients to their owners, and runs SDPA with a boolean mask built from the global
  positions of the local queries and of all keys. The gathered keys stay in rank order: softmax
  does not care about the order of keys, only the mask must match, so no reordering copy is made.
- Parameters are replicated across cp ranks and each rank's loss covers only its tokens, so the
  gradients are averaged over the cp axis too: FSDP shards over dp_shard x cp flattened
  (torchtitan's ``dp_shard_cp``; see mesh.py `fsdp_mesh`). Each rank's loss is the mean over its
  tokens; with the same number of counted tokens on every rank (no ignored labels), the mean over
  ranks is the mean over all tokens of the global batch.

Why all-gather and not ring attention: one collective per layer that any backend runs (gloo on
CPU, nccl on CUDA) with the stock SDPA kernels, so CPU tests exercise the GPU code path. torch
2.13's experimental `context_parallel` runs ring attention by intercepting the CUDA-only flash /
efficient / cuDNN SDPA ops and has no sharding rule for the CPU op (measured: "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered"). The all-gather exposes K/V communication that ring attention would overlap, and holds
all keys of the sequence at once (K/V are small under GQA: Llama 3 uses the same argument). On
CUDA an explicit mask rules out the flash kernel (SDPA picks the memory-efficient one, or the math
one where that lacks grouped-query support); this was not measured on a GPU.

Not supported (ConfigError before any process group): cp with pipeline parallelism (not built:
the schedule would need sequence-sharded micro-batches and stage shapes; see `dtorch.plan.limits`),
and models that do not declare the two hooks (e.g. transformers models), see `check_cp`. With
ignored labels (-100) the ranks' token counts differ and each rank's mean weighs equally, as
data-parallel ranks and micro-batches already do.
"""

from __future__ import annotations

import torch
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


class ContextParallel:
    """This rank's view of the cp mesh axis: the sequence shard it holds and the attention over
    the whole sequence. Plain object (not an nn.Module): it holds no state worth checkpointing."""

    def __init__(self, cp_mesh: DeviceMesh):
        assert cp_mesh.ndim == 1, cp_mesh
        self.mesh = cp_mesh
        self.size = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()
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

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
                  enable_gqa: bool = False) -> torch.Tensor:
        """Causal attention of the local queries to the keys of the whole sequence.
        q [b, heads, local_len, d], k/v [b, kv_heads, local_len, d] -> [b, heads, local_len, d]."""
        b, h, s, d = k.shape
        # K and V in one collective (one latency per layer); its backward reduce-scatters the
        # gradients of every rank's queries back to the ranks that own the keys.
        kv = all_gather_single_autograd(torch.stack((k, v)).contiguous(), gather_dim=0, group=self.mesh)
        kv = kv.view(self.size, 2, b, h, s, d).permute(1, 2, 3, 0, 4, 5).reshape(2, b, h, self.size * s, d)
        _, mask = self._tables(s, q.device)
        return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, dropout_p=dropout_p,
                                              enable_gqa=enable_gqa)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> ContextParallel:
    """Install the context-parallel hooks on `model` (a whole model, checked by `check_cp`)."""
    cp = ContextParallel(cp_mesh)
    setattr(model, POSITIONS_HOOK, cp.positions)
    for mod in _attention_modules(model):
        setattr(mod, ATTENTION_HOOK, cp.attention)
    return cp


# ---- the executor half (dtorch.parallel.halves) ---------------------------------------------------
def _apply(part: nn.Module, meshes: Meshes, plan: Plan) -> None:
    if plan.cp > 1:  # one part: the context strategy's limits refuse cp with pp
        meshes.context = apply_cp(part, sub_mesh(meshes.mesh, "cp"))


HALVES = (Half(20, apply=_apply, check=lambda model, plan, device_type: check_cp(plan, model)),)
