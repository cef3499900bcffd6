"""Reject a plan that cannot run on a model BEFORE any process group exists.

`Plan.validate` checks the plan against itself; this checks it against the model and the world:
head counts against tp, blocks against pipeline stages, micro-batches against the schedule, and
the sequence length against tp x 2*cp. Every failure is a `ConfigError` naming the field, the
value and the fix. Pure: no torch.distributed, no allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dtorch.errors import ConfigError
from dtorch.plan.plan import Plan


@dataclass(frozen=True)
class ModelDims:
    """The few model sizes a plan has to divide."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int | None = None


def _divisors(n: int) -> str:
    return "{" + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


def _first_attr(obj: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        v = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def model_dims(model: nn.Module) -> ModelDims:
    """Read layer and head counts from a model (meta is fine): its config (DTorch reference models,
    Hugging Face models) or its attributes, and the number of blocks in its block container."""
    from dtorch.model.structure import find_blocks

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
        raise ConfigError(
            "model", type(model).__name__,
            "cannot find the number of attention heads; give the model a `config` with n_heads "
            "(and n_kv_heads) or an attribute n_heads",
        )
    return ModelDims(len(blocks), heads, kv or heads, vocab)


def check_plan(
    plan: Plan, dims: ModelDims, *, seq_len: int | None = None, world_size: int | None = None,
    executable: bool = True,
) -> None:
    """Raise ConfigError if `plan` cannot run `dims` at `seq_len` on `world_size` ranks.
    `executable=False` checks only what the sharding itself needs (the dry run), not the limits of
    this executor at run time (`check_executable`)."""
    plan.validate(world_size)
    if dims.num_heads % plan.tp:
        raise ConfigError(
            "tp", plan.tp,
            f"tensor parallel degree {plan.tp} does not divide {dims.num_heads} attention heads; "
            f"use tp in {_divisors(dims.num_heads)}",
        )
    if dims.num_kv_heads % plan.tp:
        raise ConfigError(
            "tp", plan.tp,
            f"tensor parallel degree {plan.tp} does not divide {dims.num_kv_heads} key/value heads; "
            f"use tp in {_divisors(dims.num_kv_heads)}",
        )
    if plan.num_stages > dims.num_layers:
        raise ConfigError(
            "pp", plan.pp,
            f"pp * virtual_stages = {plan.num_stages} stages but the model has {dims.num_layers} blocks; "
            f"use at most {dims.num_layers} stages",
        )
    if plan.layer_partition is not None and sum(plan.layer_partition) != dims.num_layers:
        raise ConfigError(
            "layer_partition", plan.layer_partition,
            f"the counts sum to {sum(plan.layer_partition)} but the model has {dims.num_layers} blocks",
        )
    if plan.pp > 1 and plan.schedule != "gpipe" and plan.num_microbatches < plan.pp:
        raise ConfigError(
            "num_microbatches", plan.num_microbatches,
            f"schedule {plan.schedule} with pp={plan.pp} needs at least {plan.pp} micro-batches; "
            "raise num_microbatches or use schedule=gpipe",
        )
    if plan.pp > 1 and plan.schedule in ("interleaved_1f1b", "zero_bubble") and plan.num_microbatches % plan.pp:
        raise ConfigError(
            "num_microbatches", plan.num_microbatches,
            f"schedule {plan.schedule} runs micro-batches in rounds of pp={plan.pp}; use a multiple of {plan.pp}",
        )
    if seq_len is not None:
        unit = plan.tp * 2 * plan.cp if plan.cp > 1 else (plan.tp if plan.sp else 1)
        if seq_len % unit:
            why = (f"context parallel splits the sequence into tp*2*cp = {unit} load-balanced chunks"
                   if plan.cp > 1 else f"sequence parallelism splits the sequence over tp={plan.tp}")
            raise ConfigError("seq_len", seq_len, f"{why}; use a multiple of {unit}")
    if executable:
        check_executable(plan)


def check_executable(plan: Plan) -> None:
    """The limits of this executor on torch 2.13 (not of the plan): ConfigError if one is hit.
    The list lives in `dtorch.plan.limits`, so that the planner ranks only runnable plans."""
    from dtorch.plan.limits import unsupported

    why = unsupported(plan)
    if why is None:
        return
    for name in ("param_dtype", "reduce_dtype"):
        if getattr(plan, name) == "float16":
            raise ConfigError(name, "float16", f"{why}; use bfloat16 (the same range as float32, "
                              "no scaling needed) or float32")
    if plan.cp > 1 and plan.pp > 1:
        raise ConfigError("cp", plan.cp, f"{why}; use cp=1 or pp=1")
    if plan.offload == "optimizer":
        raise ConfigError("offload", plan.offload, f"{why}; use offload=params (with dp_shard > 1) or none")
    raise ConfigError("schedule", plan.schedule,
                      f"{why}; use schedule=interleaved_1f1b, sp=false, or pp*virtual_stages=2")
