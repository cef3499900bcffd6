"""ModelProfile of an arbitrary nn.Module, measured on the meta device / under FakeTensorMode.

No weights are allocated and nothing is computed: the model is built on `meta`, its repeated
blocks are found (the largest nn.ModuleList / nn.ModuleDict whose children are structurally
identical), parameters are counted, and then a copy that keeps only the first block is run once
forward on fake CPU tensors (16-bit by default) with a next-token cross-entropy loss, while we
measure inside the first block and outside it (the "head": embeddings, final norm, output, loss):

- FLOPs with `torch.utils.flop_counter.FlopCounterMode` (forward; training = 3x forward, i.e.
  backward = 2x forward). SDPA is counted over the full s x s scores, like torchtitan's MFU
  convention (see `dtorch.model.analytic`). The CPU flash-attention op has no formula in torch,
  we register the standard one for it.
- Activation bytes kept for backward with `torch.autograd.graph.saved_tensors_hooks`: every saved
  tensor's storage counted once; parameters and buffers excluded.
    none       what autograd saves;
    full       the block input only;
    selective  the block input + the outputs of matmuls and attention ops (the op-level policy
               `SELECTIVE_SAVE_OPS`: keep those, recompute norms/activations/RoPE).
  Kernel model: `nn.RMSNorm` is measured as the fused CUDA kernel keeps it (input + float32
  rstd), because on the CPU torch runs it as a composite that keeps two float32 copies; every
  other op is measured as it is (CPU flash attention keeps q, k, v, out, lse like CUDA flash).
- Tensor-parallel roles from the dataflow of the first block: in a module whose direct children
  include Linear layers, the Linears that read the module's input (or a norm's output) are
  'colwise', the last Linear called, mapping back to the block width and fed by the colwise
  outputs (in_features equal to a colwise out_features), is 'rowwise'. Outside the blocks:
  nn.Embedding 'embedding', the Linear to the vocabulary 'output', norms 'norm'. When no
  column->row pair exists, `tp_roles` is empty and `tp_roles_reason` says why.

Pitfall (DESIGN.md): torch's RuntimeEstimator / SACEstimator abort on a CPU-only machine; this
module uses only FlopCounterMode, fake tensors and saved-tensor hooks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from dtorch.errors import ConfigError
from dtorch.model.profile import ModelProfile
from dtorch.model.structure import BLOCKS_ATTR, block_items, find_blocks, find_structure

aten = torch.ops.aten

_SDPA_OPS = tuple(
    getattr(aten, n).default for n in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
    ) if hasattr(aten, n)
)
SELECTIVE_SAVE_OPS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                      aten._scaled_mm.default, *_SDPA_OPS)
"""The selective-AC policy the profile assumes: outputs of these ops are kept, the rest recomputed.
The executor's selective checkpointing should save exactly these (MUST_SAVE) to match the estimate."""


def _cpu_flash_flop(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward_flop(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# FlopCounterMode looks formulas up by overload packet.
_CUSTOM_FLOPS = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flop,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flop}


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm that keeps for backward what the fused CUDA kernel keeps: the input and float32 rstd."""

    @staticmethod
    def forward(ctx, x, weight, shape, eps):
        with torch.no_grad():
            y = F.rms_norm(x, shape, weight, eps)
        rstd = x.new_empty(x.shape[: x.dim() - len(shape)] + (1,) * len(shape), dtype=torch.float32)
        ctx.shape, ctx.eps = shape, eps
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):  # recompute: correct, and never run by the profiler
        x, weight, _ = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            w = weight.detach().requires_grad_() if weight is not None else None
            y = F.rms_norm(x, ctx.shape, w, ctx.eps)
            grads = torch.autograd.grad(y, [t for t in (x, w) if t is not None], grad)
        return grads[0], (grads[1] if w is not None else None), None, None


def _fused_rms_forward(self: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return _FusedRMSNorm.apply(x, self.weight, list(self.normalized_shape), self.eps)


# ---- the blocks: found by dtorch.model.structure (one rule for profiler, executor and monitor) ----
def _keep_first_block(container: nn.Module) -> None:
    if isinstance(container, nn.ModuleList):
        del container[1:]
    else:
        for key in list(container.keys())[1:]:
            del container[key]


# ---- the measuring run -------------------------------------------------------------------------
def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


class _Recorder(TorchDispatchMode):
    """Tracks which block-0 submodule is running; sums selective-policy op outputs inside the block;
    notes SDPA calls (head counts, and which modules do attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.in_block = False
        self.selective_bytes = 0
        self.selective_seen: set = set()
        self.attention_modules: set[str] = set()
        self.heads: tuple[int, int] | None = None
        self.ops_block = 0
        self.ops_other = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten":  # prim.* are metadata queries (fake tensors), not kernels
            if self.in_block:
                self.ops_block += 1
            else:
                self.ops_other += 1
        if self.in_block and func in SELECTIVE_SAVE_OPS:
            for t in _tensors(out):
                ref = _storage(t)
                if ref not in self.selective_seen:
                    self.selective_seen.add(ref)
                    self.selective_bytes += t.untyped_storage().nbytes()
        if self.in_block and func in _SDPA_OPS:
            self.attention_modules.update(self.stack)
            q, k = args[0], args[1]
            self.heads = (q.shape[1], k.shape[1])
        return out


def _as_logits(out: Any) -> torch.Tensor:
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.lower().endswith("norm")


def profile_module(factory_or_module: Callable[[], nn.Module] | nn.Module, seq_len: int, batch: int = 1,
                   *, name: str | None = None, dtype: torch.dtype = torch.bfloat16) -> ModelProfile:
    """Measure a causal LM: `model(tokens LongTensor[batch, seq_len])` must return logits [b, s, V]
    (or an object with `.logits`, or a tuple starting with them).

    `factory_or_module`: a zero-argument callable building the model (called under
    `torch.device("meta")`), or a module (deep-copied to meta; pass a factory for large models).
    Per-token figures divide by batch * seq_len. Activation bytes are at `dtype` (16-bit default)."""
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ConfigError("seq_len", seq_len, "must be a positive integer (tokens per sequence)")
    if isinstance(factory_or_module, nn.Module):
        model = copy.deepcopy(factory_or_module).to("meta")
    else:
        with torch.device("meta"):
            model = factory_or_module()
    if not isinstance(model, nn.Module):
        raise ConfigError("model", factory_or_module, "the factory must return an nn.Module")

    # -- parameters (whole model, shared parameters counted once) --
    block_path, container = find_blocks(model)
    if not find_structure(model).uniform:
        raise ConfigError("model", type(model).__name__,
                          f"the blocks in '{block_path}' are not identical (modules or parameter shapes differ): the "
                          f"profile measures one block and multiplies; set `model.{BLOCKS_ATTR}` to a container of "
                          "identical blocks")
    blocks = list(container.children())
    num_layers = len(blocks)
    params_total = sum(p.numel() for p in model.parameters())
    params_block = sum(p.numel() for p in blocks[0].parameters())
    tensors_block = len(list(blocks[0].parameters()))
    tensors_other = len(list(model.parameters())) - num_layers * tensors_block
    block_param_ids = {id(p) for b in blocks for p in b.parameters()}
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)
                  and not n.startswith(block_path + ".")]
    emb_params = {id(m.weight): m.weight.numel() for _, m in embeddings if id(m.weight) not in block_param_ids}
    params_embedding = sum(emb_params.values())
    params_head = params_total - num_layers * params_block - params_embedding
    vocab = max((m.num_embeddings for _, m in embeddings), default=0)
    outputs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)
               and not n.startswith(block_path + ".") and m.out_features == vocab]
    tied = any(id(m.weight) in emb_params for _, m in outputs)

    experts = _expert_shapes(blocks[0])

    # -- one forward of a one-block copy on fake tensors --
    _keep_first_block(container)
    block = next(container.children())
    assignments = _install_balanced_routing(model)
    model.to(dtype)
    for m in model.modules():
        if type(m) is nn.RMSNorm:
            m.forward = _fused_rms_forward.__get__(m)
    excluded: set = set()
    rec = _Recorder()
    saved: dict[StorageWeakRef, tuple[int, str]] = {}
    io: dict[str, tuple[list, list]] = {}
    linear_calls: list[str] = []
    flops_at: dict[str, int] = {}
    block_input: list[torch.Tensor] = []
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    counter = FlopCounterMode(display=False, custom_mapping=_CUSTOM_FLOPS)
    names = {m: n for n, m in block.named_modules()}

    def pre(mod, args, kwargs):
        n = names[mod]
        if mod is block:
            flops_at["start"] = counter.get_total_flops()
            block_input.extend(t for t in _tensors((args, kwargs)) if t.is_floating_point())
            rec.in_block = True
        rec.stack.append(n)
        io[n] = ([_storage(t) for t in _tensors((args, kwargs))], [])
        if isinstance(mod, nn.Linear):
            linear_calls.append(n)

    def post(mod, args, kwargs, out):
        n = names[mod]
        io[n][1].extend(_storage(t) for t in _tensors(out))
        rec.stack.pop()
        if mod is block:
            flops_at["end"] = counter.get_total_flops()
            rec.in_block = False

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = _storage(t)
        if ref not in excluded and ref not in saved:
            saved[ref] = (t.untyped_storage().nbytes(), "block" if rec.in_block else "head")
        return t

    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for m in block.modules()]
    handles += [m.register_forward_hook(post, with_kwargs=True) for m in block.modules()]
    try:
        with fake:
            model.to_empty(device="cpu")
            excluded.update(_storage(t) for t in (*model.parameters(), *model.buffers()))
            model.train()
            tokens = torch.zeros(batch, seq_len, dtype=torch.long)
            targets = torch.zeros(batch * seq_len, dtype=torch.long)
            with counter, rec, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = _as_logits(model(tokens))
                loss = F.cross_entropy(logits.flatten(0, -2).float(), targets)
            assert loss.dim() == 0
    finally:
        for h in handles:
            h.remove()
    if "end" not in flops_at:
        raise ConfigError("model", type(model).__name__, f"the blocks in '{block_path}' were never called")

    tokens_n = batch * seq_len
    block_fwd = flops_at["end"] - flops_at["start"]
    head_fwd = counter.get_total_flops() - block_fwd
    in_bytes = sum(t.untyped_storage().nbytes() for t in block_input[:1])
    by_region = {"block": 0, "head": 0}
    for nbytes, region in saved.values():
        by_region[region] += nbytes
    hidden = block_input[0].shape[-1] if block_input else 0

    roles, reason = _derive_roles(model, block, block_path, io, linear_calls, rec.attention_modules, hidden, vocab)
    cfg = getattr(model, "config", None)
    heads, kv_heads = rec.heads or (0, 0)
    num_heads = _cfg(cfg, "n_heads", "num_attention_heads", "n_head") or heads
    num_kv_heads = _cfg(cfg, "n_kv_heads", "num_key_value_heads") or kv_heads or num_heads
    ffn = _cfg(cfg, "ffn_hidden", "intermediate_size", "n_inner") or 4 * _cfg(cfg, "n_embd") or max(
        (m.out_features for m in block.modules() if isinstance(m, nn.Linear) and m.out_features != hidden),
        default=0)
    family = {"Llama": "llama", "LlamaForCausalLM": "llama", "GPT": "gpt", "GPT2LMHeadModel": "gpt",
              "MoETransformer": "moe"}.get(type(model).__name__, "custom")
    moe = {}
    if experts is not None and assignments:
        num_experts, per_expert, expert_hidden = experts
        top_k = sum(assignments) // (tokens_n * len(assignments))  # assignments per token, per MoE layer
        moe = dict(num_experts=num_experts, experts_per_token=top_k, params_per_expert=per_expert,
                   expert_hidden=expert_hidden, num_shared_experts=int(_cfg(cfg, "n_shared_experts")),
                   params_active=params_total - num_layers * (num_experts - top_k) * per_expert)
    return ModelProfile(
        name=name or type(model).__name__,
        family=family,
        num_layers=num_layers,
        hidden=hidden,
        num_heads=int(num_heads),
        num_kv_heads=int(num_kv_heads),
        ffn_hidden=int(ffn),
        vocab_size=vocab,
        seq_len=seq_len,
        params_total=params_total,
        params_per_block=params_block,
        params_embedding=params_embedding,
        params_head=params_head,
        flops_per_token_block=3.0 * block_fwd / tokens_n,
        flops_per_token_head=3.0 * head_fwd / tokens_n,
        act_bytes_per_token_block={
            "none": by_region["block"] / tokens_n,
            "selective": (in_bytes + rec.selective_bytes) / tokens_n,
            "full": in_bytes / tokens_n,
        },
        act_bytes_per_token_head=by_region["head"] / tokens_n,
        tp_roles=roles,
        tied_embeddings=tied,
        block_path=block_path,
        tp_roles_reason=reason,
        source="measured",
        max_seq_len=int(_cfg(cfg, "max_seq_len", "max_position_embeddings", "n_positions") or 0),
        ops_per_block=rec.ops_block,
        ops_head=rec.ops_other,
        tensors_per_block=tensors_block,
        tensors_other=tensors_other,
        **moe,
    )


# ---- mixtures of experts -----------------------------------------------------------------------
def _expert_shapes(block: nn.Module) -> tuple[int, int, int] | None:
    """(routed experts, parameters per expert, expert hidden width) of a block holding stacked expert
    weights (a module declaring the `dispatcher` hook, weights [num_experts, ...]); None if dense."""
    for m in block.modules():
        if hasattr(type(m), "dispatcher"):
            weights = list(m.parameters(recurse=False))
            if weights and all(w.dim() == 3 for w in weights):
                n = weights[0].shape[0]
                return n, sum(w.numel() for w in weights) // n, int(weights[0].shape[1])
    return None


def _install_balanced_routing(model: nn.Module) -> list[int]:
    """On fake tensors the router's choices cannot be read: modules that declare the
    `assignment_counts` hook get balanced per-expert counts (FLOPs and saved bytes are linear in the
    counts, so any split of the same total measures the same). Returns the list that records each
    routed layer's number of assignments."""
    seen: list[int] = []

    def balanced(n: int, num_experts: int) -> list[int]:
        seen.append(n)
        return [n // num_experts + (1 if e < n % num_experts else 0) for e in range(num_experts)]

    for m in model.modules():
        if hasattr(type(m), "assignment_counts"):
            m.assignment_counts = balanced
    return seen


def _cfg(cfg: Any, *keys: str) -> int:
    for k in keys:
        v = getattr(cfg, k, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return 0


def _derive_roles(model: nn.Module, block: nn.Module, block_path: str, io: dict, linear_calls: list[str],
                  attention_modules: set[str], hidden: int, vocab: int) -> tuple[dict[str, str], str]:
    """Roles from the recorded dataflow of block 0 (see the module docstring); ({}, reason) if none."""
    mods = dict(block.named_modules())
    norm_outputs = {ref for n, m in mods.items() if _is_norm(m) and n in io for ref in io[n][1]}
    roles: dict[str, str] = {}
    for pname in mods:
        linears = [n for n in linear_calls if n.rpartition(".")[0] == pname and n in mods]
        if not linears or pname not in io:
            continue
        feeds = set(io[pname][0]) | norm_outputs
        col = [n for n in dict.fromkeys(linears) if set(io[n][0]) & feeds]
        row = linears[-1]
        r = mods[row]
        if (row in col or not col or r.out_features != hidden
                or r.in_features not in {mods[c].out_features for c in col}):
            continue
        roles.update({c: "colwise" for c in col})
        roles[row] = "rowwise"
        if pname in attention_modules and pname:
            roles[pname] = "attention"
    refused = _executor_refuses_tp(model)
    if refused:
        return {}, refused
    if not roles and (adapted := _adapted_roles(model)):
        return adapted, ""
    if not roles:
        kinds = sorted({type(m).__name__ for m in block.modules() if m is not block})
        return {}, (f"no column->row pair of nn.Linear layers found in block '{block_path}.0' "
                    f"(submodule types: {', '.join(kinds)}); tensor parallelism needs a manual plan")
    roles.update({n: "norm" for n, m in mods.items() if n and _is_norm(m)})
    for n, m in model.named_modules():
        if not n or n == block_path or n.startswith(block_path + "."):
            continue
        if isinstance(m, nn.Embedding):
            roles[n] = "embedding"
        elif isinstance(m, nn.Linear) and m.out_features == vocab:
            roles[n] = "output"
        elif _is_norm(m):
            roles[n] = "norm"
    return roles, ""


def _executor_refuses_tp(model: nn.Module) -> str:
    """The tensor-parallel executor's own verdict (dtorch.model.tp_rules, on the model as the executor
    sees it): a fused projection it cannot split per head, or a replicated parameter inside
    the TP region it cannot reduce, names the layer; '' when it accepts. (Layers it finds no role for
    are left to the annotation message at apply time.)"""
    from dtorch.model.hf import adapt
    from dtorch.model.tp_rules import check_block, mark_region

    try:
        adapted = adapt(model)
        path, blocks = find_blocks(adapted)
        for name, block in block_items(blocks):
            check_block(block, f"{path}.{name}")
        mark_region(adapted)
    except ConfigError as e:
        return f"{e.value}: {e.fix}" if e.field == "tp" else ""
    return ""


def _adapted_roles(model: nn.Module) -> dict[str, str]:
    """Block roles of a transformers model the executor rebuilds for TP (GPT-2's fused Conv1D become
    q/k/v Linears, dtorch.parallel.hf), by the executor's names; {} for any other model."""
    from dtorch.model.hf import adapt, is_transformers_model
    from dtorch.model.tp_rules import layer_roles

    if not is_transformers_model(model):
        return {}
    try:
        _, blocks = find_blocks(adapt(model))
        block = block_items(blocks)[0][1]
    except (ConfigError, IndexError):
        return {}
    return {**layer_roles(block), **{n: "norm" for n, m in block.named_modules() if n and _is_norm(m)}}
