"""Reject a plan that cannot run on a model BEFORE any process group exists.

`Plan.validate` checks the plan against itself; this checks it against the model and the world:
head counts against tp, blocks against pipeline stages, micro-batches against the schedule, and
the sequence length against tp x 2*cp. The rules are the strategies' (`dtorch.plan.strategies`),
the same the planner checks its plans with; this module reads the model's sizes. Every failure is
a `ConfigError` naming the field, the value and the fix. Pure: no torch.distributed, no allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dtorch.errors import ConfigError
from dtorch.plan import strategies
from dtorch.plan.plan import Plan
from dtorch.plan.strategies import Dims


@dataclass(frozen=True)
class ModelDims:
    """The few model sizes a plan has to divide. `num_heads` is 0 when the model has no attention
    heads DTorch can find (a CNN, an MLP): only tensor and context parallelism need them."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int | None = None
    num_experts: int = 0


def _first_attr(obj: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        v = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def model_dims(model: nn.Module) -> ModelDims:
    """Read layer and head counts from a model (meta is fine): its config (DTorch reference models,
    Hugging Face models) or its attributes, else the `num_heads` of its attention modules
    (nn.MultiheadAttention and look-alikes); and the number of repeated blocks (1 when the model has
    none: it is one unit). Heads are 0 when none are found."""
    from dtorch.model.structure import block_items, find_blocks

    _, blocks = find_blocks(model)
    sources = [getattr(model, "config", None), getattr(model, "args", None), model]
    heads = kv = vocab = None
    for src in sources:
        if src is None:
            continue
        heads = heads or _first_attr(src, ("n_heads", "num_heads", "num_attention_heads", "n_head"))
        kv = kv or _first_attr(src, ("n_kv_heads", "num_kv_heads", "num_key_value_heads"))
        vocab = vocab or _first_attr(src, ("vocab_size", "vocab"))
    if heads is None:
        heads = next((h for m in model.modules() if m is not model
                      and (h := _first_attr(m, ("num_heads", "n_heads", "num_attention_heads")))), None)
    experts = _first_attr(getattr(model, "config", None) or {}, ("n_experts", "num_experts", "num_local_experts"))
    # a model without repeated blocks is one unit: one "layer" for the pipeline rule (pp=1 only)
    return ModelDims(len(block_items(blocks)) or 1, heads or 0, kv or heads or 0, vocab, experts or 0)


def _needs_heads(plan: Plan, dims: ModelDims, model_name: str) -> None:
    """Tensor and context parallelism split attention by heads: a model without them cannot use
    either (data parallelism, FSDP, activation checkpointing and compile need no head count)."""
    for field, degree in (("tp", plan.tp), ("cp", plan.cp)):
        if degree > 1 and dims.num_heads == 0:
            raise ConfigError(field, degree, f"{model_name}: no attention heads found (no `config` with n_heads, no "
                              "module with num_heads); give the model a config with n_heads and n_kv_heads, "
                              f"or use {field}=1")


def check_plan(
    plan: Plan, dims: ModelDims, *, seq_len: int | None = None, world_size: int | None = None,
    executable: bool = True,
) -> None:
    """Raise ConfigError if `plan` cannot run `dims` at `seq_len` on `world_size` ranks: every
    strategy's rules, the same the planner's `search.check` runs (`dtorch.plan.strategies.check`).
    `executable=False` checks only what the sharding itself needs (the dry run), not the limits of
    this executor at run time (`check_executable`)."""
    plan.validate()  # the document's version, then the rules over the plan alone
    _needs_heads(plan, dims, "the model")
    # the suggested degrees are the model's: the world may still be the plan's own (no process group yet)
    strategies.check(plan, Dims(dims.num_layers, dims.num_heads, dims.num_kv_heads, None, seq_len,
                                seq_field="seq_len", num_experts=dims.num_experts), world=world_size)
    if executable:
        check_executable(plan)


def check_executable(plan: Plan) -> None:
    """The limits of this executor on torch 2.13 (not of the plan): ConfigError naming the field to
    change if one is hit. Each strategy declares its own (`Strategy.limits`), so that the planner
    ranks only runnable plans."""
    strategies.check_executable(plan)


# ---- does each strategy apply to this model: the planner's rule, on facts read off the model ----
def check_applies(plan: Plan, profile) -> None:
    """ConfigError naming the field when `plan` uses a strategy that cannot apply to the model
    (`Strategy.unsupported_for` over `profile`: the measured ModelProfile, or `model_facts`). The
    same rule the planner's search follows, so a plan it ranked is never refused here."""
    strategies.check_applies(plan, profile)


def model_facts(model: nn.Module, plan: Plan, sample: tuple | None = None, seq_len: int | None = None):
    """The model-side facts the strategies' `unsupported_for` reads, read off `model` (meta is fine)
    as a ModelProfile whose sizes are 0: head and expert counts and ties always; whether TP roles,
    context parallelism and a pipeline cut apply only when `plan` asks for tp, cp or pp > 1 (the
    pipeline cut runs the model forward once on meta: `dtorch.model.split`). `sample`: one
    micro-batch of model inputs (a tuple); default token ids [microbatch_size, seq_len]."""
    import torch

    from dtorch.model.profile import ModelProfile
    from dtorch.model.split import pipeline_reason
    from dtorch.model.structure import block_items, find_blocks
    from dtorch.parallel.cp import check_cp
    from dtorch.parallel.tp import block_plan, check_heads, mark_region

    dims = model_dims(model)
    if sample is None:
        sample = (torch.zeros(plan.microbatch_size, seq_len or 8, dtype=torch.long, device="meta"),)
    first = next((t for t in sample if isinstance(t, torch.Tensor)), None)
    tokens = first is not None and not first.is_floating_point() and first.dim() == 2
    tp_reason = cp_reason = pp_reason = ""
    if plan.tp > 1 and dims.num_heads:
        try:
            path, blocks = find_blocks(model)
            for name, block in block_items(blocks):
                block_plan(block, f"{path}.{name}", plan.sp)
            mark_region(model, plan.sp)
            check_heads(model)
        except ConfigError as e:
            tp_reason = f"{e.value}: {e.fix}"  # (the layer, and what it lacks)
    if plan.cp > 1:
        try:
            check_cp(plan, model)
        except ConfigError as e:
            cp_reason = e.fix
    if plan.pp > 1:
        pp_reason = pipeline_reason(model, sample)
    return ModelProfile(
        name=type(model).__name__, family="custom", num_layers=dims.num_layers, hidden=0,
        num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads, ffn_hidden=0, vocab_size=dims.vocab_size or 0,
        seq_len=seq_len or 0, params_total=0, params_per_block=0, params_embedding=0, params_head=0,
        flops_per_token_block=0.0, flops_per_token_head=0.0, num_experts=dims.num_experts,
        tp_roles_reason=tp_reason, context_reason=cp_reason, pipeline_reason=pp_reason,
        input_kind="tokens" if tokens else "other",
    )
