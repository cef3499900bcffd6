"""The strategy registry: every parallelism and policy declared once, for planner and executor alike.

One file per strategy (`batch`, `precision`, `data`, `fsdp`, `zero`, `expert`, `context`, `tensor`, `memory`,
`pipeline`, `compile`), each an instance of `base.Strategy`. Everything that used to repeat a strategy's
knowledge is a loop over `REGISTRY`: `Plan.validate` and `Plan.family/describe` (`validate`,
`family`, `describe`), the planner's and the executor's checks (`check`), what this executor
cannot run (`limits`), the `--fix` fields and their aliases (`FIXABLE`, `FIX_ALIASES`,
`normalize_fixed`), the cost model's time terms and the search's lower bound (`dtorch.plan.cost`).

The order of `REGISTRY` is the order of family names (FSDP before CP before TP before PP) and of
the executor's limits (the first one hit is the one reported). Torch-free.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from dtorch.cluster.spec import Cluster
from dtorch.errors import ConfigError, choices
from dtorch.model.profile import ModelProfile
from dtorch.plan.strategies.base import (
    Dims,
    Field,
    Limit,
    RankLoad,
    RankShare,
    Strategy,
    Violation,
    positive_int,
)
from dtorch.plan.strategies.batch import BATCH
from dtorch.plan.strategies.compile import COMPILE
from dtorch.plan.strategies.context import CONTEXT
from dtorch.plan.strategies.data import DATA
from dtorch.plan.strategies.expert import EXPERT
from dtorch.plan.strategies.fsdp import FSDP
from dtorch.plan.strategies.memory import AC_POLICIES, MEMORY, OFFLOAD_POLICIES
from dtorch.plan.strategies.pipeline import PIPELINE, SCHEDULES
from dtorch.plan.strategies.precision import DTYPES, PRECISION
from dtorch.plan.strategies.tensor import TENSOR
from dtorch.plan.strategies.zero import ZERO

REGISTRY: tuple[Strategy, ...] = (BATCH, PRECISION, DATA, FSDP, ZERO, EXPERT, CONTEXT, TENSOR, MEMORY, PIPELINE,
                                  COMPILE)

FIELDS: dict[str, Field] = {f.name: f for s in REGISTRY for f in s.fields}
OWNER: dict[str, Strategy] = {f.name: s for s in REGISTRY for f in s.fields}
MESH_AXES: tuple[str, ...] = tuple(sorted((f.name for f in FIELDS.values() if f.mesh_position is not None),
                                          key=lambda n: FIELDS[n].mesh_position))
"""Mesh axes, outermost first: pp, dp_replicate, dp_shard, cp, tp (tp innermost, on the fastest links)."""
_INTS = (*MESH_AXES, *(n for n, f in FIELDS.items() if f.kind == "int"))
_MESH_FIELDS = tuple(n for n in FIELDS if n in MESH_AXES)
TIMED = tuple(s for s in REGISTRY if type(s).rank_time is not Strategy.rank_time)
"""The strategies with time terms, in registry order: the cost model keeps those whose `prepare`
says they apply to the plan, and adds their `rank_time` on every pipeline rank."""
DEGREED = tuple(sorted((s for s in REGISTRY if type(s).mesh_degrees is not Strategy.mesh_degrees),
                       key=lambda s: -FIELDS[s.axis].mesh_position))
"""The strategies whose mesh degree the search picks from the model (`Strategy.mesh_degrees`),
innermost axis first: tp (the fastest links), cp (its chunks depend on tp), pp; the data-parallel
axes take the devices left."""
_FIXED_RULES = tuple(s for s in REGISTRY if type(s).fixed_rules is not Strategy.fixed_rules)
BOUNDED = tuple(s for s in REGISTRY if s.bound_terms)
"""The strategies whose time terms the search's lower bound adds (`Strategy.bound_terms`)."""
PACE_BOUNDED = tuple(s for s in REGISTRY if type(s).bound_pace is not Strategy.bound_pace)
SYNC_BOUNDED = tuple(s for s in REGISTRY if type(s).bound_sync is not Strategy.bound_sync)
_OPTIMISTIC = tuple(s for s in REGISTRY if type(s).optimistic is not Strategy.optimistic)
_BOUND_PLANS = tuple(s for s in REGISTRY if type(s).bound_plans is not Strategy.bound_plans)
PACED = tuple(s for s in REGISTRY if type(s).pace_terms is not Strategy.pace_terms)
"""The strategies with per-step terms at the pipeline's pace (`Strategy.pace_terms`: the pipeline's)."""
COUNTING = tuple(s for s in REGISTRY if type(s).counts is not Strategy.counts)
"""The strategies that fill fields of a step's `StepCounts` (`Strategy.counts`: the tensor strategy's)."""
WORKING = tuple(s for s in REGISTRY if type(s).work is not Strategy.work)
"""The strategies that add to a rank's own work after the compute term (`Strategy.work`)."""
HOLDING = tuple(s for s in REGISTRY if type(s).held is not Strategy.held)
"""The strategies that change what a rank holds of its stage (`Strategy.held`), in registry order."""
MEMORY_TERMS = tuple(s for s in REGISTRY if type(s).rank_memory is not Strategy.rank_memory)
"""The strategies with memory terms (`Strategy.rank_memory`), in registry order."""
_LIMITED = tuple(s for s in REGISTRY if type(s).limits is not Strategy.limits)
_REFUSING = tuple(s for s in REGISTRY if type(s).unsupported_for is not Strategy.unsupported_for)
_FAMILY_KEY = attrgetter(*dict.fromkeys(f for s in REGISTRY for f in s.family_fields))
_FAMILIES: dict[tuple, str] = {}
FIXABLE: tuple[str, ...] = (*MESH_AXES, *(n for n, f in FIELDS.items() if f.fixable and n not in MESH_AXES))
FIX_ALIASES: dict[str, str] = {a: f.name for f in FIELDS.values() for a in f.aliases}
DECLARED: tuple[Field, ...] = tuple(f for f in FIELDS.values() if f.plan_type is not None)
"""The Plan fields strategies declare themselves (`Field.plan_type`): `declare_fields` adds them."""
DECLARED_NAMES: tuple[str, ...] = tuple(f.name for f in DECLARED)
_VARIANTS = tuple(s for s in REGISTRY if type(s).variants is not Strategy.variants)
_NOTES = tuple(s for s in REGISTRY if type(s).notes is not Strategy.notes)
_ONCE = tuple(s for s in REGISTRY if type(s).once_s is not Strategy.once_s)

__all__ = ["REGISTRY", "FIELDS", "MESH_AXES", "FIXABLE", "FIX_ALIASES", "Dims", "Field", "Limit", "RankLoad",
           "RankShare", "Strategy", "Violation", "AC_POLICIES", "OFFLOAD_POLICIES", "SCHEDULES", "DTYPES",
           "validate", "check", "limits", "unsupported", "check_executable", "refusals", "refused_fields",
           "check_applies", "family", "describe",
           "normalize_fixed", "penalty", "DECLARED", "declare_fields", "pinned", "variants", "notes", "once_s",
           "amortised_s"]


def declare_fields(cls: type) -> type:
    """Class decorator, under ``@dataclass``: add the fields strategies declare (`DECLARED`) to the
    Plan class with their defaults, after the ones written in plan.py. A new strategy's field then
    lives in its own file; plan.py does not change."""
    ann = cls.__dict__.get("__annotations__")
    if ann is None:
        ann = cls.__annotations__ = {}
    for f in DECLARED:
        if f.name in ann:
            raise TypeError(f"Plan field {f.name} is declared twice: in plan.py and by a strategy")
        ann[f.name] = f.plan_type
        setattr(cls, f.name, f.default)
    cls.DECLARED_DOCS = {f.name: f.doc for f in DECLARED}
    return cls


def pinned(fixed: dict[str, Any]) -> dict[str, Any]:
    """The declared fields among the fixed ones: what the search sets on every plan it builds."""
    return {n: fixed[n] for n in DECLARED_NAMES if n in fixed}


def variants(plan: Any, fixed: dict[str, Any], cluster: Cluster) -> list[Any]:
    """Every strategy's variants of `plan`, combined (a variant of one strategy is offered to the
    ones after it: a compiled plan reducing in bf16)."""
    out: list[Any] = []
    for s in _VARIANTS:
        out += [v for p in [plan, *out] for v in s.variants(p, fixed, cluster)]
    return out


def notes(plan: Any, cluster: Cluster) -> list[str]:
    """What the strategies say `plan` costs beyond its step time."""
    return [n for s in _NOTES for n in s.notes(plan, cluster)]


def once_s(plan: Any, cluster: Cluster) -> float:
    """Seconds `plan` costs once per run beyond its steps (compilation), summed over the strategies."""
    return sum(s.once_s(plan, cluster) for s in _ONCE)


def amortised_s(step_time_s: float, plan: Any, cluster: Cluster, steps: int | None) -> float:
    """Seconds per step over a run of `steps` steps, the one-off seconds included:
    (step_time x steps + once_s) / steps; the step time itself when the run length is unknown."""
    return step_time_s + once_s(plan, cluster) / steps if steps else step_time_s


def optimistic(degrees: dict[str, int]) -> dict[str, Any]:
    """The fields of the search's lower-bound plan on a mesh of `degrees`, every strategy's."""
    return {k: v for s in _OPTIMISTIC for k, v in s.optimistic(degrees).items()}


def bound_plans(plan: Any, profile: ModelProfile) -> list[Any]:
    """The lower bound's plan and its variants (`Strategy.bound_plans`), combined over the strategies."""
    plans = [plan]
    for s in _BOUND_PLANS:
        plans = [v for p in plans for v in s.bound_plans(p, profile)]
    return plans


def check_fixed(fixed: dict[str, Any], profile: ModelProfile, world: int) -> None:
    """ConfigError on the first rule the `--fix` fields break on their own (`Strategy.fixed_rules`)."""
    for s in _FIXED_RULES:
        for v in s.fixed_rules(fixed, profile, world):
            raise v.error()


def world_size(plan: Any) -> int:
    n = 1
    for axis in MESH_AXES:
        n *= getattr(plan, axis)
    return n


def validate(plan: Any, world: int | None = None) -> None:
    """The plan against itself (and, given, the world size): ConfigError on the first broken rule."""
    for name in _INTS:
        v = getattr(plan, name)
        if not positive_int(v):
            raise ConfigError(name, v, "must be a positive integer")
    for s in REGISTRY:
        for v in s.rules(plan, None):
            raise v.error()
    if world is not None and world_size(plan) != world:
        raise ConfigError("degrees", {a: getattr(plan, a) for a in MESH_AXES},
                          f"pp*dp_replicate*dp_shard*cp*tp = {world_size(plan)} but the world size is {world}")


def check(plan: Any, dims: Dims, world: int | None = None) -> None:
    """The plan against a model and a world (`Dims`): the planner's `search.check` and the
    executor's `parallel.check.check_plan` both call this. `world` (default `dims.world_size`) is
    the world size the degrees must make; `dims.world_size` also narrows the suggested degrees."""
    validate(plan, world if world is not None else dims.world_size)
    for s in REGISTRY:
        for v in s.rules(plan, dims):
            raise v.error()


def limits(plan: Any) -> list[Limit]:
    """What this executor cannot run of `plan`, in registry order (empty: it runs)."""
    return [lim for s in REGISTRY for lim in s.limits(plan)]


def first_limit(plan: Any) -> Limit | None:
    for s in _LIMITED:
        for lim in s.limits(plan):
            return lim
    return None


def unsupported(plan: Any) -> str | None:
    """Why `plan` cannot run on this executor (torch 2.13), or None if it can."""
    lim = first_limit(plan)
    return lim.why if lim else None


def check_executable(plan: Any) -> None:
    """ConfigError naming the field to change if `plan` hits a limit of this executor."""
    lim = first_limit(plan)
    if lim:
        raise lim.error()


def refusals(profile: ModelProfile) -> dict[str, str]:
    """Strategy name -> why it cannot apply to the model `profile` describes (`Strategy.unsupported_for`),
    in registry order; the strategies absent apply."""
    return {s.name: why for s in _REFUSING if (why := s.unsupported_for(profile))}


def refused_fields(profile: ModelProfile) -> dict[str, str]:
    """Plan field -> why it must stay 1 for this model (the `refusal_fields` of every refused strategy)."""
    return {f: why for s in _REFUSING if (why := s.unsupported_for(profile)) for f in s.refusal_fields}


def check_applies(plan: Any, profile: ModelProfile) -> None:
    """ConfigError naming the field when `plan` uses a strategy that cannot apply to this model: the
    one rule the planner's search (which never tries such a degree) and the executor
    (`dtorch.parallel.check.check_applies`, before any process group) share."""
    for name, why in refused_fields(profile).items():
        value = getattr(plan, name)
        if value != 1:
            raise ConfigError(name, value, why if f"use {name}=1" in why else f"{why}; use {name}=1")


def family(plan: Any) -> str:
    """A short name of the strategy family, e.g. 'FSDP', 'FSDPxTP', 'TPxPP', 'DDP', 'single'.
    Memoised on the strategies' `family_fields`."""
    key = _FAMILY_KEY(plan)
    name = _FAMILIES.get(key)
    if name is None:
        name = _FAMILIES[key] = "x".join(p for s in REGISTRY if (p := s.family(plan))) or "single"
    return name


def describe(plan: Any) -> str:
    """One line: degrees, micro-batching and policies."""
    deg = " ".join(f"{a}={getattr(plan, a)}" for a in MESH_AXES if getattr(plan, a) > 1) or "single device"
    parts = sorted((pos, i, text) for i, s in enumerate(REGISTRY) for pos, text in s.describe(plan))
    return f"{deg} {' '.join(text for _, _, text in parts)}"


def penalty(plan: Any) -> float:
    """The ranking handicap of a plan: the product of every strategy's."""
    out = 1.0
    for s in REGISTRY:
        out *= s.penalty(plan)
    return out


def normalize_fixed(fixed: dict[str, Any] | None) -> dict[str, Any]:
    """Resolve aliases and types of `--fix` fields; ConfigError for unknown keys or bad values."""
    out: dict[str, Any] = {}
    for key, val in (fixed or {}).items():
        k = FIX_ALIASES.get(key, key)
        if k not in FIXABLE:
            raise ConfigError("fix", key, "unknown plan field; " + choices(list(FIXABLE) + sorted(FIX_ALIASES)))
        out[k] = _value(FIELDS[k], val)
    return out


def _value(f: Field, val: Any) -> Any:
    if f.kind in ("degree", "int"):
        try:
            iv = int(val)
            if isinstance(val, bool) or iv != float(val) or iv < 1:
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f.name, val, "must be a positive integer") from None
        return iv
    if f.kind == "bool":
        if isinstance(val, bool):
            return val
        if str(val).lower() in ("1", "true", "yes", "on"):
            return True
        if str(val).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f.name, val, "use true or false")
    v = str(val).lower()
    v = dict(f.value_aliases).get(v, v)
    refused = dict(f.refuse)
    if v in refused:
        raise ConfigError(f.name, val, refused[v])
    if v not in f.choices:
        raise ConfigError(f.name, val, choices(f.choices))
    return int(v) if f.plan_type == "int" else v  # (a numbered choice: zero's stage)
