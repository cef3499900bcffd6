"""ModelProfile of an arbitrary nn.Module, measured on the meta device / under FakeTensorMode.

No weights are allocated and nothing is computed: the model is built on `meta`, its repeated
blocks are found (`dtorch.model.structure`), parameters are counted, and then a copy that keeps
only the first block (every block, when they differ) is run once forward on fake copies of ONE
REAL BATCH of the user's data (`sample`; 16-bit by default) followed by the user's loss, while we
measure inside the blocks and outside them (the "head": embeddings, stem, final norm, output,
loss). Only a language model (first layer an nn.Embedding) may be profiled without a sample, on
token ids. A forward that branches on tensor values cannot run on fake tensors: it is measured on
a real CPU copy when that is small (`REAL_FALLBACK_BYTES`). A model that has no repeated blocks is
measured as one block. Any failure of the user's forward is a one-line ConfigError naming the
module and the op:

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
  other op is measured as it is (CPU flash attention keeps q, k, v, out, lse like CUDA flash),
  but attention with dropout, which a CPU runs through the math kernel (s x s scores in float32)
  and a GPU's fused kernels take: measured as the GPU runs it with `fused_attention`.
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

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from dtorch.errors import ConfigError
from dtorch.model.loss import cross_entropy
from dtorch.model.outputs import batch_size, call_model, is_token_input, logits_of
from dtorch.model.profile import ModelProfile
from dtorch.model.split import pipeline_reason
from dtorch.model.structure import block_items, context_hooks_reason, find_blocks, find_structure, join

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
    else:  # a ModuleDict, or a Sequential whose run of blocks is part of its children
        for name, _ in block_items(container)[1:]:
            delattr(container, name)


# ---- the measuring run -------------------------------------------------------------------------
def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


class _Recorder(TorchDispatchMode):
    """Tracks which block-0 submodule is running; sums selective-policy op outputs inside the
    blocks; notes SDPA calls (head counts, and which modules do attention) and the op that failed."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.in_block = False
        self.selective_bytes = 0
        self.selective_float32_bytes = 0
        self.selective_seen: set = set()
        self.attention_modules: set[str] = set()
        self.heads: tuple[int, int] | None = None
        self.ops_block = 0
        self.ops_other = 0
        self.failed_op: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            out = func(*args, **(kwargs or {}))
        except Exception:
            self.failed_op = self.failed_op or str(func)
            raise
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
                    if t.dtype == torch.float32:
                        self.selective_float32_bytes += t.untyped_storage().nbytes()
        if self.in_block and func in _SDPA_OPS:
            self.attention_modules.update(self.stack)
            q, k = args[0], args[1]
            self.heads = (q.shape[1], k.shape[1])
        return out


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.lower().endswith("norm")


Sample = tuple[Any, Any]
"""(model input, target) of one batch, as `dtorch.train.data.batch_for` gives it."""

SAMPLE_HELP = ("give DTorch one real batch: the Trainer passes its data; for `dtorch plan --model pkg.module:factory` "
               "define `example_input()` in that module, returning (inputs, target) of one batch (docs/models.md)")

# Fake tensors cannot decide a branch on values: such a model is measured on real CPU tensors, when
# a copy this size is cheap to build.
REAL_FALLBACK_BYTES = 2 * 2**30
_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)


REGIONS = ("block", "before", "output", "head")
"""Where a saved tensor was saved: in the measured blocks; outside them before the first ran (floating
point: held by the first pipeline stage through its backward; token ids go with the head, a few
bytes a token); the last block's output its own op keeps (see `_count_chain_once`); outside the
blocks after them (freed before the blocks' backward)."""

_FAMILIES = {"Llama": "llama", "LlamaForCausalLM": "llama", "GPT": "gpt", "GPT2LMHeadModel": "gpt",
             "MoETransformer": "moe"}
"""The profile's `family` by the model's class name (the cost model's per-family terms); else "custom"."""


def profile_module(factory_or_module: Callable[[], nn.Module] | nn.Module, seq_len: int, batch: int = 1,
                   *, sample: Sample | None = None, loss: Callable[[Any, Any], torch.Tensor] | None = None,
                   name: str | None = None, dtype: torch.dtype = torch.bfloat16,
                   fused_attention: bool = False) -> ModelProfile:
    """Measure a model's FLOPs, activation bytes and parameters on one batch, allocating nothing.

    `sample`: (inputs, target) of one real batch (the Trainer's data, collated: a tensor, a tuple or
    a dict of tensors; docs/models.md). The model runs once on fake copies of it, then
    `loss(logits_of(output), target)` (without `loss`: the mean of the output). Token input (one
    integer tensor [b, s]) gives per-token figures at s tokens; any other input gives per-sample
    figures (`seq_len` = 1, `input_kind` = "other": a sample counts as one token).
    Without `sample` the model must be a language model whose first layer is an nn.Embedding:
    `model(tokens LongTensor[batch, seq_len])` returning logits [b, s, V] (or `.logits`, or a tuple
    starting with them), measured with next-token cross entropy.

    `factory_or_module`: a zero-argument callable building the model (called under
    `torch.device("meta")`), or a module (deep-copied to meta; pass a factory for large models).
    Activation bytes are at `dtype` (16-bit default). A model that fails to run raises a one-line
    ConfigError naming the module and the op.

    `fused_attention`: measure scaled-dot-product attention as a GPU runs it, where a fused kernel
    takes dropout too (`_Attention`); False: as this CPU runs it (with dropout, the math kernel,
    which keeps the s x s scores). `attention_dropout` in the profile says whether it mattered."""
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ConfigError("seq_len", seq_len, "must be a positive integer (tokens per sequence)")
    label = name or getattr(factory_or_module, "__name__", None) or type(factory_or_module).__name__
    model = _meta_model(factory_or_module, label)
    label = name or type(model).__name__
    if sample is None:
        sample, loss = _language_model_sample(model, label, batch, seq_len), loss or _next_token
    inputs, target = sample
    tokens_input = is_token_input(inputs)
    batch = batch_size(inputs) or 1
    seq = int(inputs.shape[1]) if tokens_input else 1
    tokens_n = batch * seq

    block_path, blocks, uniform, num_layers, pc = _blocks_and_parameters(model)
    experts = _expert_shapes(blocks[0]) if blocks else None

    # -- can the blocks be cut into pipeline stages: one meta forward of the whole model (dtorch.model.split) --
    split_reason = _split_reason(model, blocks, inputs)

    # -- one forward of a one-block copy (every block if they differ) on fake tensors --
    with _Attention(fused_attention) as attention:
        m = _measure_any(factory_or_module, sample, loss, dtype, uniform, label, pc.total)
        assignments = list(m.assignments)  # (as measured: the routing hook stays on the copy)
        roles, reason = _block_roles(m, block_path, pc.vocab, factory_or_module, label) if blocks else (
            {}, "the model has no repeated blocks (tensor parallelism splits blocks)")
        tp_split, f32_tp_split = ({}, {}) if experts else _tp_split(factory_or_module, sample, loss, dtype, uniform,
                                                                    label, roles, tokens_input, tokens_n, m)
    rec, block = m.rec, m.block
    measured = max(1, m.block_calls)
    hidden, act_block = _activations(m, bool(blocks), tokens_input, tokens_n)
    f32_block, f32_head = _float32_activations(m, bool(blocks), tokens_n, dtype)
    cfg = getattr(model, "config", None)
    num_heads, num_kv_heads, ffn = _widths(cfg, rec, block, hidden)
    moe = _moe_facts(experts, assignments, tokens_n, cfg, pc.total, num_layers)
    context_reason = context_hooks_reason(model) if tokens_input else (
        f"the model input is not a token sequence ({_describe(inputs)}): context parallelism shards a token "
        "sequence")
    return ModelProfile(
        name=label,
        family=_FAMILIES.get(type(model).__name__, "custom"),
        num_layers=num_layers,
        hidden=hidden,
        num_heads=int(num_heads),
        num_kv_heads=int(num_kv_heads),
        ffn_hidden=int(ffn),
        vocab_size=pc.vocab,
        seq_len=seq,
        params_total=pc.total,
        params_per_block=pc.block,
        params_embedding=pc.embedding,
        params_head=pc.head,
        flops_per_token_block=3.0 * m.block_flops / measured / tokens_n,
        flops_per_token_head=3.0 * (m.total_flops - m.block_flops) / tokens_n,
        act_bytes_per_token_block=act_block,
        **_head_bytes(m, tokens_n),
        act_bytes_float32_per_token_block=f32_block,
        act_bytes_float32_per_token_head=f32_head,
        composite_norms_measured=_composite_norms(block),
        **_block_bytes(m, tokens_n),
        act_bytes_tp_split_per_token_block=tp_split,
        act_bytes_float32_tp_split_per_token_block=f32_tp_split,
        tp_roles=roles,
        tied_embeddings=pc.tied,
        block_path=block_path,
        tp_roles_reason=reason,
        pipeline_reason=split_reason,
        context_reason=context_reason,
        input_kind="tokens" if tokens_input else "other",
        source="measured",
        max_seq_len=int(_cfg(cfg, "max_seq_len", "max_position_embeddings", "n_positions") or 0),
        ops_per_block=rec.ops_block // measured,
        ops_head=rec.ops_other,
        tensors_per_block=pc.tensors_block,
        tensors_other=pc.tensors_other,
        attention_dropout=attention.dropout,
        **moe,
    )


def _blocks_and_parameters(model: nn.Module) -> tuple[str, list[nn.Module], bool, int, _ParamCounts]:
    """(block path, blocks, uniform, layers, parameter counts: whole model, shared ones once)."""
    block_path, container = find_blocks(model)
    items = block_items(container)
    blocks = [m for _, m in items]
    num_layers = max(1, len(blocks))
    pc = _count_parameters(model, blocks, tuple(join(block_path, n) for n, _ in items), num_layers)
    return block_path, blocks, find_structure(model).uniform, num_layers, pc


def _block_bytes(m: _Measurement, tokens_n: int) -> dict[str, Any]:
    """The profile's figures of a block's backward working set and its unfused attention's scores."""
    return {"backward_working_bytes_per_token_block": m.backward_working / tokens_n,
            "unfused_attention": m.scores_bytes > 0,
            "act_bytes_per_token_block_scores": m.scores_bytes / max(1, m.block_calls) / tokens_n}


class _Attention(TorchFunctionMode):
    """Every `F.scaled_dot_product_attention` call of the measuring runs: whether one asks for
    dropout (`dropout`), and with `fused`, each such call run with dropout_p 0, which is what a GPU's
    fused kernels keep with dropout as without (q, k, v, the output and its log-sum-exp; their
    random state, not a mask). A CPU runs attention with dropout through the math kernel instead:
    the s x s scores, softmax and mask, upcast to float32 in a 16-bit run."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused, self.dropout = fused, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            positional = len(args) > 4
            if (args[4] if positional else kwargs.get("dropout_p", 0.0)):
                self.dropout = True
                if self.fused and positional:
                    args = (*args[:4], 0.0, *args[5:])
                elif self.fused:
                    kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)


def _language_model_sample(model: nn.Module, label: str, batch: int, seq_len: int) -> Sample:
    """The sample of a model given none: token ids [batch, seq_len] and their flat targets (the
    analytic profile's op count is of this loss); the model must start with an nn.Embedding."""
    _require_embedding(model, label)
    return torch.zeros(batch, seq_len, dtype=torch.long), torch.zeros(batch * seq_len, dtype=torch.long)


def _block_roles(m: Any, block_path: str, vocab: int, factory_or_module: Any, label: str) -> tuple[dict, str | None]:
    """(tensor-parallel roles of the measured block's modules, why there are none), from the run `m`,
    and none where the attention does not split by heads (`_heads_reason`)."""
    block_input = m.block_input[0] if m.block_input else None
    width = int(block_input.shape[-1]) if block_input is not None and block_input.dim() else 0
    roles, reason = _derive_roles(m.model, m.block, block_path, m.io, m.linear_calls, m.rec.attention_modules,
                                  width, vocab)
    if roles and not reason and (reason := _heads_reason(factory_or_module, label)):
        return {}, reason
    return roles, reason


class _DataDependent(Exception):
    """The fake run met a branch on tensor values."""


@dataclass
class _Measurement:
    model: nn.Module
    block: nn.Module | None
    """The first measured block (the whole model when it has no repeated blocks)."""
    rec: _Recorder
    io: dict
    linear_calls: list[str]
    block_input: list[torch.Tensor]
    by_region: dict[str, int]
    """Saved bytes by `REGIONS`."""
    float32_by_region: dict[str, int]
    """Of `by_region`, the bytes saved as float32 tensors."""
    block_flops: int
    total_flops: int
    block_calls: int
    assignments: list[int]
    fake: bool = True
    """Measured on fake tensors (else on real ones: a model that branches on values)."""
    backward_working: int = 0
    """`_backward_working_set` of the first block (0: not measured)."""
    scores_bytes: int = 0
    """Of the blocks' saved bytes, the per-head s x s tensors (`_is_scores`): an unfused attention core's."""


@dataclass(frozen=True)
class _ParamCounts:
    """Parameters of the whole model (shared ones counted once), per block, of the input embeddings
    and of the rest (the head); parameter tensors per block and outside; the vocabulary; tied head."""

    total: int
    block: int
    embedding: int
    head: int
    tensors_block: int
    tensors_other: int
    vocab: int
    tied: bool


def _count_parameters(model: nn.Module, blocks: list[nn.Module], block_paths: tuple[str, ...],
                      num_layers: int) -> _ParamCounts:
    def outside(n: str) -> bool:
        return not any(n == b or n.startswith(b + ".") for b in block_paths)

    params_total = sum(p.numel() for p in model.parameters())
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding) and outside(n)]
    if blocks:
        block_param_ids = {id(p) for b in blocks for p in b.parameters()}
        params_blocks = sum(p.numel() for b in blocks for p in b.parameters())
        tensors_blocks = sum(len(list(b.parameters())) for b in blocks)
        emb_params = {id(m.weight): m.weight.numel() for _, m in embeddings if id(m.weight) not in block_param_ids}
    else:  # no repeated blocks: the whole model is its one unit
        params_blocks, tensors_blocks, emb_params = params_total, len(list(model.parameters())), {}
    params_embedding = sum(emb_params.values())
    vocab = max((m.num_embeddings for _, m in embeddings), default=0)
    outputs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)
               and outside(n) and m.out_features == vocab]
    return _ParamCounts(
        total=params_total, block=params_blocks // num_layers, embedding=params_embedding,
        head=params_total - params_blocks - params_embedding, tensors_block=tensors_blocks // num_layers,
        tensors_other=len(list(model.parameters())) - tensors_blocks, vocab=vocab,
        tied=any(id(m.weight) in emb_params for _, m in outputs))


def _split_reason(model: nn.Module, blocks: list[nn.Module], inputs: Any) -> str | None:
    """Why the blocks cannot be cut into pipeline stages (None: they can)."""
    if not blocks:
        return "the model has no repeated blocks to cut into stages"
    if not isinstance(inputs, torch.Tensor):
        return (f"the model takes {_describe(inputs)}: pipeline stages pass one tensor from stage to "
                "stage")
    return pipeline_reason(model, (inputs.to("meta"),))


def _measure_any(factory_or_module: Any, sample: Sample, loss: Any, dtype: torch.dtype, uniform: bool, label: str,
                 params_total: int) -> _Measurement:
    """`_measure` on fake tensors, or on real ones where the model branches on values."""
    try:
        # a fresh build, not a deep copy: a forward patched onto an instance (a closure over the
        # original module) would run the original's meta weights beside the copy's fake ones
        return _measure(_meta_model(factory_or_module, label), sample, loss, dtype, uniform, fake=True, label=label)
    except _DataDependent:
        # a branch on values (a block that picks a branch by its input): measure on real tensors
        real = _real_model(factory_or_module, params_total, label)
        return _measure(real, sample, loss, dtype, uniform, fake=False, label=label)


def _activations(m: _Measurement, has_blocks: bool, tokens_input: bool, tokens_n: int) -> tuple[int, dict]:
    """(hidden width, saved activation bytes per token per block by AC policy) of a measurement."""
    measured = max(1, m.block_calls)
    in_bytes = sum(t.untyped_storage().nbytes() for t in m.block_input[:1])
    block_input = m.block_input[0] if m.block_input else None
    if block_input is None:
        hidden = 0
    elif tokens_input:
        hidden = int(block_input.shape[-1])
    else:  # per sample: the width of one sample's block input
        hidden = int(block_input.numel() // max(1, block_input.shape[0])) if block_input.dim() else 1
    block_saved = m.by_region["block"] / measured / tokens_n
    if has_blocks:
        act_block = {"none": block_saved, "selective": (in_bytes + m.rec.selective_bytes / measured) / tokens_n,
                     "full": in_bytes / tokens_n}
    else:  # nothing to checkpoint: activation checkpointing has no block to wrap
        act_block = {"none": block_saved, "selective": block_saved, "full": block_saved}
    return hidden, act_block


def _head_bytes(m: _Measurement, tokens_n: int) -> dict[str, float]:
    """The profile's figures of the bytes saved outside the blocks, per token (`REGIONS`)."""
    return {"act_bytes_per_token_head": (m.by_region["head"] + m.by_region["before"] + m.by_region["output"]) / tokens_n,
            "act_bytes_per_token_before_blocks": m.by_region["before"] / tokens_n,
            "act_bytes_per_token_last_block_output": m.by_region["output"] / tokens_n}


def _float32_activations(m: _Measurement, has_blocks: bool, tokens_n: int,
                         dtype: torch.dtype) -> tuple[dict[str, float], float]:
    """(per block by AC policy, head): the bytes per token of `_activations`' figures that the 16-bit
    measuring run saved as float32 tensors, i.e. that the model keeps in float32 whatever its compute
    dtype (an explicit upcast, softmax statistics, a math attention kernel's scores). Nothing when the
    run was float32 itself (no 16-bit figure to tell them apart in)."""
    if dtype == torch.float32:
        return {}, 0.0
    measured = max(1, m.block_calls)
    block = m.float32_by_region["block"] / measured / tokens_n
    head = sum(m.float32_by_region[r] for r in ("head", "before", "output")) / tokens_n
    if not has_blocks:
        return dict.fromkeys(("none", "selective", "full"), block), head
    inp = sum(t.untyped_storage().nbytes() for t in m.block_input[:1] if t.dtype == torch.float32)
    return {"none": block, "selective": (inp + m.rec.selective_float32_bytes / measured) / tokens_n,
            "full": inp / tokens_n}, head


def _tp_split(factory_or_module: Any, sample: Sample, loss: Any, dtype: torch.dtype, uniform: bool, label: str,
              roles: dict[str, str], tokens_input: bool, tokens_n: int,
              measured: _Measurement) -> tuple[dict[str, float], dict[str, float]]:
    """(bytes per token per block by AC policy that tensor parallelism splits over its ranks, their
    float32 share), measured as a TP rank runs the block: the model as the executor sees it
    (`dtorch.model.hf.adapt`) once whole and once with its column-wise linears' outputs and its
    row-wise linears' inputs halved (two ranks' heads and hidden units: the executor's own rule), the
    split bytes being twice the difference. ({}, {}) without column/row roles, or where the halved
    block does not run (a forward that hard-codes its head count). `measured` is the profile's own
    run: the whole run itself where it was fake and the executor sees the model as it is (not a
    transformers model, which it adapts)."""
    from dtorch.model.tp_rules import halve_linears

    if not any(r in ("colwise", "rowwise") for r in roles.values()):
        return {}, {}
    from dtorch.model.hf import adapt, is_transformers_model

    runs = []
    for halve in (False, True):
        try:
            model = adapt(_meta_model(factory_or_module, label))
            if not halve and measured.fake and not is_transformers_model(model):
                runs.append(measured)  # (the same model, sample and run as the profile's)
                continue
            if halve:
                _, container = find_blocks(model)
                for _, blk in block_items(container):
                    halve_linears(blk, roles)
            runs.append(_measure(model, sample, loss, dtype, uniform, fake=True, label=label))
        except (ConfigError, _DataDependent, AttributeError, ValueError):
            return {}, {}
    (_, whole), (_, half) = (_activations(r, True, tokens_input, tokens_n) for r in runs)
    f32_whole, f32_half = (_float32_activations(r, True, tokens_n, dtype)[0] for r in runs)
    split = {ac: max(0.0, 2.0 * (whole[ac] - half[ac])) for ac in whole}
    return split, {ac: max(0.0, 2.0 * (f32_whole[ac] - f32_half[ac])) for ac in f32_whole}


def _composite_norms(block: nn.Module | None) -> bool:
    """Whether the block's RMSNorms are the model's own modules (a class named *RMSNorm that is not
    nn.RMSNorm, e.g. transformers' LlamaRMSNorm): measured as their composite operators run, where
    an nn.RMSNorm is counted as the fused kernel keeps it (`_FusedRMSNorm`)."""
    if block is None:
        return False
    norms = [type(sub) for sub in block.modules() if type(sub).__name__.lower().endswith("rmsnorm")]
    return bool(norms) and nn.RMSNorm not in norms


def _widths(cfg: Any, rec: Any, block: nn.Module | None, hidden: int) -> tuple[int, int, int]:
    """(attention heads, key/value heads, MLP width): the model's config where it says, else measured."""
    heads, kv_heads = rec.heads or (0, 0)
    if not heads and block is not None:  # nn.MultiheadAttention and look-alikes
        heads = next((h for sub in block.modules() if isinstance(h := getattr(sub, "num_heads", None), int)), 0)
    num_heads = _cfg(cfg, "n_heads", "num_attention_heads", "n_head") or heads
    num_kv_heads = _cfg(cfg, "n_kv_heads", "num_key_value_heads") or kv_heads or num_heads
    ffn = _cfg(cfg, "ffn_hidden", "intermediate_size", "n_inner") or 4 * _cfg(cfg, "n_embd") or max(
        (sub.out_features for sub in (block.modules() if block is not None else ())
         if isinstance(sub, nn.Linear) and sub.out_features != hidden), default=0)
    return num_heads, num_kv_heads, ffn


def _moe_facts(experts: tuple[int, int, int] | None, assignments: list[int], tokens_n: int, cfg: Any,
               params_total: int, num_layers: int) -> dict:
    """The mixture-of-experts fields of the profile (empty for a dense model)."""
    if experts is None or not assignments:
        return {}
    num_experts, per_expert, expert_hidden = experts
    top_k = sum(assignments) // (tokens_n * len(assignments))  # assignments per token, per MoE layer
    return dict(num_experts=num_experts, experts_per_token=top_k, params_per_expert=per_expert,
                expert_hidden=expert_hidden, num_shared_experts=int(_cfg(cfg, "n_shared_experts")),
                params_active=params_total - num_layers * (num_experts - top_k) * per_expert)


def _meta_model(factory_or_module: Any, label: str) -> nn.Module:
    try:
        if isinstance(factory_or_module, nn.Module):
            model = copy.deepcopy(factory_or_module).to("meta")
        else:
            with torch.device("meta"):
                model = factory_or_module()
    except Exception as e:  # noqa: BLE001 - the user's code: one line, not a traceback
        raise ConfigError("model", label, f"building it on the meta device failed: {_one_line(e)}; the factory must "
                          "take no arguments and build the module without reading tensor values") from None
    if not isinstance(model, nn.Module):
        raise ConfigError("model", label, "the factory must return an nn.Module")
    return model


def _real_model(factory_or_module: Any, params: int, label: str) -> nn.Module:
    """The model built for real on the CPU (seeded), for a model the fake run cannot measure."""
    if params * 4 > REAL_FALLBACK_BYTES:
        raise ConfigError("model", label, "its forward branches on tensor values, which DTorch measures on real "
                          f"tensors, but {params:,} parameters are too many to build for that; profile it with a "
                          "smaller config of the same shape")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if isinstance(factory_or_module, nn.Module):
            model = copy.deepcopy(factory_or_module).to("cpu")
            if any(t.is_meta for t in model.parameters()):
                model.to_empty(device="cpu")
                for p in model.parameters():
                    nn.init.normal_(p, std=0.02)
        else:
            with torch.device("cpu"):
                model = factory_or_module()
    return model


def _require_embedding(model: nn.Module, label: str) -> None:
    """Token ids are invented only for a language model (its first layer is an nn.Embedding)."""
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if not isinstance(first, nn.Embedding):
        kind = type(first).__name__ if first is not None else "no parameter"
        raise ConfigError("model", label, f"its first layer is {kind}, not an nn.Embedding, so DTorch cannot invent "
                          f"token ids for it; {SAMPLE_HELP}")


def _next_token(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The executor's default loss as a single rank runs it (`dtorch.train.losses.next_token`)."""
    return cross_entropy(logits.flatten(0, -2), target.flatten())


def _describe(inputs: Any) -> str:
    if isinstance(inputs, torch.Tensor):
        return f"{inputs.dtype} {list(inputs.shape)}"
    if isinstance(inputs, dict):
        return "a dict of " + ", ".join(inputs)
    return type(inputs).__name__


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def _prepare_copy(model: nn.Module, uniform: bool, dtype: torch.dtype) -> tuple[str, list[nn.Module], list[int]]:
    """Ready `model` (a copy) for `_measure`: its blocks reduced to the first when `uniform`, balanced
    routing installed, cast to `dtype`, RMSNorms fused. Returns (block path, blocks, the routing's
    assignment counts)."""
    block_path, container = find_blocks(model)
    blocks = [b for _, b in block_items(container)]
    if blocks and uniform:
        _keep_first_block(container)
        blocks = blocks[:1]
    assignments = _install_balanced_routing(model)
    model.to(dtype)
    for sub in model.modules():
        if type(sub) is nn.RMSNorm:
            sub.forward = _fused_rms_forward.__get__(sub)
    return block_path, blocks, assignments


def _measure(model: nn.Module, sample: Sample, loss_fn: Any, dtype: torch.dtype, uniform: bool, *, fake: bool,
             label: str) -> _Measurement:
    """One forward + loss of `model` (blocks reduced to the first when `uniform`) on `sample`,
    on fake tensors (`fake`) or on real CPU tensors, measuring FLOPs, saved bytes and dataflow."""
    block_path, blocks, assignments = _prepare_copy(model, uniform, dtype)
    measured = blocks or [model]
    block = measured[0]
    excluded: set = set()
    rec = _Recorder()
    saved: dict[StorageWeakRef, tuple[int, str, bool]] = {}
    io: dict[str, tuple[list, list]] = {}
    linear_calls: list[str] = []
    block_input: list[torch.Tensor] = []
    block_output: list[StorageWeakRef] = []
    outputs: list[torch.Tensor] = []  # the first block call's outputs that need a gradient
    scores: set[StorageWeakRef] = set()
    counter = FlopCounterMode(display=False, custom_mapping=_CUSTOM_FLOPS)
    names = {sub: n for n, sub in block.named_modules()}
    paths = {sub: n for n, sub in model.named_modules()}
    measured_set = set(measured)
    starts: list[int] = []
    running: list[str] = []  # the user's modules being run, innermost last (named in an error)
    totals = {"block": 0, "calls": 0}

    def pre(mod, args, kwargs):
        running.append(paths.get(mod, "?"))
        if mod in measured_set:
            starts.append(counter.get_total_flops())
            if not block_input:
                block_input.extend(t for t in _tensors((args, kwargs)) if t.is_floating_point())
            rec.in_block = True
        n = names.get(mod)
        if n is not None:
            rec.stack.append(n)
            io[n] = ([_storage(t) for t in _tensors((args, kwargs))], [])
            if isinstance(mod, nn.Linear):
                linear_calls.append(n)

    def post(mod, args, kwargs, out):
        running.pop()
        n = names.get(mod)
        if n is not None:
            io[n][1].extend(_storage(t) for t in _tensors(out))
            rec.stack.pop()
        if mod in measured_set:
            totals["block"] += counter.get_total_flops() - starts.pop()
            totals["calls"] += 1
            rec.in_block = False
            if not block_output:
                block_output.extend(_storage(t) for t in _tensors(out))
                outputs.extend(t for t in _tensors(out) if t.requires_grad)

    seq = int(sample[0].shape[1]) if is_token_input(sample[0]) else 0
    batch = int(sample[0].shape[0]) if seq else 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = _storage(t)
        if ref not in excluded and ref not in saved:
            region = "block" if rec.in_block else "head" if totals["calls"] or not t.is_floating_point() else "before"
            saved[ref] = (t.untyped_storage().nbytes(), region, t.dtype == torch.float32)
            if region == "block" and seq > 1 and _is_scores(t, batch, seq):
                scores.add(ref)
        return t

    handles = [sub.register_forward_pre_hook(pre, with_kwargs=True) for sub in model.modules()]
    handles += [sub.register_forward_hook(post, with_kwargs=True) for sub in model.modules()]
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    try:
        with mode:
            if fake:
                model.to_empty(device="cpu")
            excluded.update(_storage(t) for t in (*model.parameters(), *model.buffers()))
            model.train()
            inputs, target = tree_map_only(
                torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, _cpu(sample))
            with counter, rec, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = logits_of(call_model(model, inputs))
                if loss_fn is not None:
                    loss = loss_fn(out, target)
                else:  # no loss given: the output's mean stands in (its cost is the head's)
                    loss = sum(t.float().mean() for t in _tensors(out) if t.is_floating_point())
            working = _backward_working_set(loss, outputs, block_input, saved, excluded, block_output) if blocks else 0
    except _DATA_DEPENDENT:
        raise _DataDependent() from None
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's forward: one line naming where it failed
        raise _forward_failed(model, label, sample, running[-1] if running else "", rec.failed_op, e) from None
    finally:
        for h in handles:
            h.remove()
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ConfigError("loss", label, "the loss must return a 0-d tensor (the mean loss of the batch)")
    if blocks and not totals["calls"]:
        raise ConfigError("model", label, f"the blocks in '{block_path}' were never called by its forward")
    if blocks and uniform and len(blocks) == 1:
        _count_chain_once(saved, block_input, block_output)
    return _Measurement(model, block if blocks else None, rec, io, linear_calls, block_input, *_by_region(saved),
                        totals["block"], counter.get_total_flops(), totals["calls"], assignments,
                        fake, working, sum(saved[ref][0] for ref in scores))


def _is_scores(t: torch.Tensor, batch: int, seq: int) -> bool:
    """Whether a tensor a block saves is an unfused attention's per-head s x s scores, softmax or
    mask: [batch, heads, s, s], or with the heads folded into the batch for `bmm`, [batch x heads,
    s, s] with more than one head (a [batch, s, h] activation whose h happens to equal s is not)."""
    if t.dim() not in (3, 4) or t.shape[-1] != seq or t.shape[-2] != seq:
        return False
    return t.dim() == 4 or (t.shape[0] > batch > 0 and t.shape[0] % batch == 0)


def _by_region(saved: dict) -> tuple[dict[str, int], dict[str, int]]:
    """The saved bytes by `REGIONS`, and of them the float32 tensors'."""
    by_region, float32_by_region = dict.fromkeys(REGIONS, 0), dict.fromkeys(REGIONS, 0)
    for nbytes, region, float32 in saved.values():
        by_region[region] += nbytes
        float32_by_region[region] += nbytes if float32 else 0
    return by_region, float32_by_region


def _forward_failed(model: nn.Module, label: str, sample: Sample, where: str, op: str | None,
                    e: Exception) -> ConfigError:
    """The one-line error of a user's forward that failed in module `where` ('': the loss) at `op`."""
    module = f"'{where}' ({type(model.get_submodule(where)).__name__})" if where else "the loss"
    at = f" at {op}" if op else ""
    return ConfigError("model", label, f"running it on one batch ({_describe(sample[0])}) failed in {module}{at}: "
                       f"{_one_line(e)}; check that the data's items match the model's forward (docs/models.md)")


class _Live(TorchDispatchMode):
    """Bytes alive beyond those at the window's start, at their most, while the window is open:
    every op's new output storage counts until it is freed, and so does each storage in `known`
    (what the forward saved); never `excluded` (the parameters and buffers)."""

    def __init__(self, known: dict[StorageWeakRef, int], excluded: set) -> None:
        super().__init__()
        self.live, self.excluded = dict(known), excluded
        self.open = False
        self.start = self.peak = self.incoming = 0

    def total(self) -> int:
        for ref in [r for r in self.live if r.expired()]:
            del self.live[ref]
        return sum(self.live.values())

    def begin(self, grad: torch.Tensor) -> None:
        """The window opens with the gradient of the block's output, counted as made in it."""
        self.open, self.start = True, self.total()
        self.live.setdefault(_storage(grad), grad.untyped_storage().nbytes())
        self.incoming = grad.untyped_storage().nbytes()

    def end(self) -> None:
        if self.open:
            self.peak = max(self.peak, self.total() - self.start)
        self.open = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.open:  # (nothing is freed before this returns: the op's inputs are still referenced)
            for t in _tensors(out):
                ref = _storage(t)
                if ref not in self.excluded:
                    self.live.setdefault(ref, t.untyped_storage().nbytes())
            self.peak = max(self.peak, self.total() - self.start)
        return out


def _backward_working_set(loss: torch.Tensor, outputs: list[torch.Tensor], block_input: list[torch.Tensor],
                          saved: dict, excluded: set, block_output: list[StorageWeakRef]) -> int:
    """The first block's backward, on the measured tensors: the most bytes it holds beyond what was
    alive when its output's gradient arrived, net of the saved tensors it has freed by then and of
    that gradient where it stands in for the block's output, freed by the backward of the next
    block that kept it (`memory.block_working_set`'s net convention; a block whose own last op
    keeps its output, a ReLU, frees it here). The gradients of its activations only: weight
    gradients are not formed (only the block input's gradient is asked for). 0 where it cannot be
    measured (an input without a gradient, a block output outside the loss's graph)."""
    wanted = [t for t in block_input[:1] if t.requires_grad]
    if not wanted or not outputs or not loss.requires_grad:
        return 0
    live = _Live({ref: nbytes for ref, (nbytes, _, _) in saved.items()}, excluded)
    handles = [outputs[0].register_hook(live.begin), wanted[0].register_hook(lambda g: live.end())]
    try:
        with live:
            torch.autograd.grad(loss, wanted, allow_unused=True)
    except Exception:  # noqa: BLE001 - a backward the fake tensors cannot run: priced by family instead
        return 0
    finally:
        for h in handles:
            h.remove()
    live.end()
    own = any(saved.get(ref, (0, "head", False))[1] in ("block", "output") for ref in block_output)
    return max(0, live.peak - (0 if own else live.incoming))


def _count_chain_once(saved: dict, block_input: list[torch.Tensor], block_output: list[StorageWeakRef]) -> None:
    """One block measured for all (`uniform`): where it saves both its input and its own output (a
    block ending in a ReLU that keeps its result, followed by one whose first op keeps its input),
    each block's output is the next block's saved input, one tensor counted twice per block by the
    one-block figure. Its bytes move to the head: every block then counts its input, and the head the
    last block's output (the only one no later block keeps: region "output")."""
    first_input = _storage(block_input[0]) if block_input else None
    if first_input is None or saved.get(first_input, (0, "head", False))[1] != "block":
        return  # the input is kept by what runs before the block (or not at all): no double count
    for ref in block_output:
        if ref in saved and saved[ref][1] == "block" and ref != first_input:
            nbytes, _, float32 = saved[ref]
            saved[ref] = (nbytes, "output", float32)


def _cpu(sample: Sample) -> Sample:
    return tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), sample)


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
    field, refused = _executor_refuses_tp(model)
    if field == "tp":  # a layer it cannot split
        return {}, refused
    if not roles and (adapted := _adapted_roles(model)):
        return adapted, ""
    if not roles:
        kinds = sorted({type(m).__name__ for m in block.modules() if m is not block})
        return {}, (f"no column->row pair of nn.Linear layers found in block '{block_path}.0' "
                    f"(submodule types: {', '.join(kinds)}); tensor parallelism needs a manual plan")
    if refused:  # pairs in the dataflow, but a layer the executor knows no role for: not offered either
        return {}, refused
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


def _heads_reason(factory_or_module: Any, label: str) -> str:
    """The executor's head check (`dtorch.model.tp_rules.check_heads`) on the model as it sees it, on
    the meta device: its line when the attention does not split by heads, else ''."""
    from dtorch.model.hf import adapt
    from dtorch.model.tp_rules import check_heads

    try:
        check_heads(adapt(_meta_model(factory_or_module, label)))
    except ConfigError as e:
        return f"{e.value}: {e.fix}"
    return ""


def _executor_refuses_tp(model: nn.Module) -> tuple[str, str]:
    """The tensor-parallel executor's own verdict (dtorch.model.tp_rules, on the model as the executor
    sees it): a fused projection it cannot split per head, a replicated parameter inside the TP
    region it cannot reduce, or a linear layer it knows no role for (the executor takes roles from
    names and annotations, not from this dataflow): (the error's field, its line naming the layer and
    the fix); ("", "") when it accepts."""
    from dtorch.model.hf import adapt
    from dtorch.model.tp_rules import check_block, mark_region

    try:
        adapted = adapt(model)
        path, blocks = find_blocks(adapted)
        for name, block in block_items(blocks):
            check_block(block, f"{path}.{name}")
        mark_region(adapted)
    except ConfigError as e:
        return e.field, f"{e.value}: {e.fix}"
    return "", ""


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
