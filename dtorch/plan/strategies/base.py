"""The contract every strategy fills in (see `docs/adding-a-strategy.md`).

A strategy is one way of spreading a model (data parallel, FSDP, tensor, context, pipeline) or one
policy that changes what a step costs (checkpointing and offload, precision). It declares, once,
for the planner and the executor alike:

- `fields`: the Plan fields it owns, with their kind, choices and `--fix` aliases;
- `rules(plan, dims)`: what makes a plan inconsistent, as `Violation(field, value, fix)`;
  with `dims` None only the plan itself is checked, with `Dims` the model and world too;
- `limits(plan)`: what this DTorch's executor cannot run (the planner never ranks such plans,
  `dtorch.parallel.check` refuses them before any process group exists);
- `unsupported_for(profile)`: why it cannot apply to this model at all (from the model-side facts of
  its `ModelProfile`), None if it can; the search then never tries a degree > 1 of its
  `refusal_fields`, `dtorch plan` lists it as not offered, and the executor refuses such a plan;
- `family(plan)` / `describe(plan)`: its part of the strategy family name and the one-line form;
- `degrees(...)`: the search's candidates for its mesh axis;
- `prepare(step)` / `rank_time(step, load, r, counts)`: its time terms over the shared step shape
  (`dtorch.plan.step.StepShape`; per-plan values in its own record, `step.keep` / `step.term`),
  filled into the rank's share `r`; the search's lower bound calls the same terms with optimistic
  settings;
- `held(step, load, m)` / `rank_memory(step, load, m)`: its memory terms, into the rank's `RankMemory`;
- `executor`: the module of `dtorch.parallel` that applies it; it declares `HALVES`, the steps
  `parallelize` runs in order (`dtorch.parallel.halves`).

Torch-free, and free of `dtorch.plan.plan` (the Plan imports the registry, not the reverse): a
strategy reads a plan's fields by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from dtorch.cluster.spec import Cluster
from dtorch.errors import ConfigError
from dtorch.model.profile import ModelProfile
from dtorch.plan.step import (  # noqa: F401  (re-exported: the terms' records)
    CostConstants,
    RankLoad,
    RankMemory,
    RankShare,
    StepCounts,
    StepShape,
)


@dataclass(frozen=True)
class Field:
    """One Plan field a strategy owns. `kind`: 'degree' (a mesh axis, positive int), 'int'
    (positive int), 'bool' or 'choice' (one of `choices`, after `value_aliases`)."""

    name: str
    kind: str
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    """Other names `--fix` accepts for the field (``fsdp`` for dp_shard)."""
    value_aliases: tuple[tuple[str, str], ...] = ()
    """Other spellings of choices (``bf16`` for bfloat16)."""
    fixable: bool = True
    mesh_position: int | None = None
    """Position of a mesh axis, outermost first (pp 0 ... tp 4)."""
    refuse: tuple[tuple[str, str], ...] = ()
    """Values `--fix` refuses with a reason (float8: not implemented by this executor)."""
    plan_type: str | None = None
    """Set by a strategy that declares the Plan field itself (the annotation, e.g. ``"bool"``): the
    registry adds it to the Plan dataclass with `default` (see `strategies.declare_fields`), so
    the strategy's file is the only place it is written down. None: the field is in plan.py."""
    default: Any = None
    """The declared field's default; it must mean "off", so every older plan document still loads."""
    doc: str = ""
    """What the declared field does (plan.py's field docstrings, for declared fields)."""
    omit_default: bool = False
    """A declared field left out of the plan document while at its default (`Plan.to_dict`): plan
    files and golden plans written before it existed stay byte-identical."""


@dataclass(frozen=True, slots=True)
class StepTerm:
    """Seconds a strategy adds once per step at the pipeline's pace, not per rank (the pipeline's
    bubble and point-to-point sends): `key` is its entry of `Estimate.time_breakdown`."""

    key: str
    seconds: float


@dataclass(frozen=True)
class Violation:
    """A broken rule: the field, the value seen and what to do instead."""

    field: str
    value: Any
    fix: str

    def error(self) -> ConfigError:
        return ConfigError(self.field, self.value, self.fix)


@dataclass(frozen=True)
class Limit:
    """Something this executor cannot run: `why` (the planner's note) and the field to change with
    `fix` (the executor's error)."""

    why: str
    field: str
    value: Any
    fix: str

    def error(self) -> ConfigError:
        return ConfigError(self.field, self.value, f"{self.why}; {self.fix}")


@dataclass(frozen=True)
class Dims:
    """What a plan is checked against beyond itself: the model's sizes, and where known the world
    size and the sequence length. `seq_field` is the field a bad sequence length is reported on:
    `seq_len` in the executor (the data's length is an argument), None in the planner (the model's
    length is given, so the plan's own field is at fault: cp, sp)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    world_size: int | None = None
    seq_len: int | None = None
    seq_field: str | None = "seq_len"
    name: str = "the model"
    num_experts: int = 0
    """Routed experts per MoE block (0: a dense model)."""


class Strategy:
    """Defaults: a strategy that owns no fields and changes nothing. Subclasses override."""

    name: str = ""
    fields: tuple[Field, ...] = ()
    executor: str | None = None
    """The module of `dtorch.parallel` that applies it."""
    family_fields: tuple[str, ...] = ()
    """The Plan fields `family` reads (the registry memoises family names on them)."""

    refusal_fields: tuple[str, ...] = ()
    """The fields that must stay 1 when `unsupported_for` refuses the model (its mesh degree)."""
    bound_terms: bool = False
    """Its `prepare`/`rank_time` never overestimate on the search's optimistic plan (`optimistic`;
    async TP, no small collectives): the search's lower bound adds them (the tensor strategy's
    activation traffic, large on every plan of a mesh)."""

    @property
    def axis(self) -> str | None:
        """Its mesh axis: the name of its `degree` field, if it has one."""
        return next((f.name for f in self.fields if f.kind == "degree"), None)

    def rules(self, plan: Any, dims: Dims | None) -> Iterator[Violation]:
        return iter(())

    def limits(self, plan: Any) -> Iterator[Limit]:
        return iter(())

    def unsupported_for(self, profile: ModelProfile) -> str | None:
        """Why this strategy cannot apply to the model `profile` (a `ModelProfile`) describes, in one
        line naming what is missing, or None if it can. Reads only the profile's model-side facts
        (`tp_roles_reason`, `pipeline_reason`, `context_reason`, `input_kind`, `num_heads`,
        `num_experts`, ...), so the planner (from the profile) and the executor (from the same facts
        read off the model, `dtorch.parallel.check`) give the same answer."""
        return None

    def family(self, plan: Any) -> str | None:
        return None

    def describe(self, plan: Any) -> Iterable[tuple[int, str]]:
        """(position, text) parts of the one-line form."""
        return ()

    # ---- the search ------------------------------------------------------------------------------
    def mesh_degrees(self, rest: int, profile: ModelProfile, cluster: Cluster, picked: dict[str, int]) -> list[int]:
        """The search's candidates for its mesh `axis` with `rest` devices left once the inner axes
        took theirs (`picked`: axis -> degree), before `--fix` and `unsupported_for` narrow them.
        Overridden by the strategies whose degree depends on the model (tp, cp, pp); the
        data-parallel axes take what is left."""
        return [1]

    def fixed_rules(self, fixed: dict[str, Any], profile: ModelProfile, world: int) -> Iterator[Violation]:
        """What the `--fix` fields (normalised) break on their own for this model and `world`
        devices, before the search builds any plan (ep not dividing the experts)."""
        return iter(())

    def optimistic(self, degrees: dict[str, int]) -> dict[str, Any]:
        """Its fields on the search's lower-bound plan of a mesh with `degrees` (axis -> degree):
        the settings no plan of the mesh is faster than (the pipeline's smallest bubble)."""
        return {}

    def bound_pace(self, step: StepShape, t: float, n: int) -> float:
        """Seconds the lower bound adds per step at the pace of `t`, the rank's seconds for a step of
        `n` micro-batches of the smallest size (the pipeline's bubble); never more than any plan's."""
        return 0.0

    def bound_sync(self, step: StepShape, load: RankLoad, p_stage: float) -> float:
        """Seconds of gradient and parameter traffic this strategy adds to the lower bound, before the
        contention floor exposes a share of it: no per-unit or per-bucket latencies (FSDP, DDP)."""
        return 0.0

    def bound_plans(self, plan: Any, profile: ModelProfile) -> list[Any]:
        """Variants of the lower bound's plan whose traffic the bound takes the least of (expert
        parallelism's degrees: a larger ep shrinks the replicas' all-reduce); default `[plan]`."""
        return [plan]

    # ---- time and memory ---------------------------------------------------------------------------
    def prepare(self, step: StepShape) -> bool:
        """Whether `rank_time` has anything to add for this plan; if so, compute once per plan what
        it needs for every rank (collectives whose size does not depend on the pipeline rank) as
        the strategy's own typed record, ``return step.keep(Record(...))``, which `rank_time` reads
        back with ``step.term(Record)``. A value another strategy reads is a declared field of
        `StepShape` (`tp_act`), never an open attribute."""
        return True

    def rank_time(self, step: StepShape, load: RankLoad, r: RankShare, counts: StepCounts) -> None:
        """Add this strategy's per-micro-batch and per-step seconds to `r` (after `prepare`)."""

    def pace_terms(self, step: StepShape, t_mb: float) -> tuple[StepTerm, ...]:
        """Seconds this strategy adds once per step when the slowest pipeline rank takes `t_mb` per
        micro-batch, in the order the step time sums them (the pipeline's bubble, then its sends)."""
        return ()

    def counts(self, plan: Any, blocks: float, head_share: float, c: CostConstants, selective: str) -> dict[str, float]:
        """The `StepCounts` fields this strategy fills for a pipeline rank with `blocks` blocks and
        `head_share` of the embedding and head (the tensor strategy's latency-bound collectives);
        the fields it leaves out stay 0."""
        return {}

    def work(self, step: StepShape, load: RankLoad, r: RankShare, flops_mb: float) -> None:
        """Add to the rank's own work per micro-batch (`r.compute`, `r.recompute`) once the shared
        compute term has priced the micro-batch's `flops_mb`: before host overhead and collectives,
        which depend on it. Every strategy, whether or not `prepare` kept it (activation
        checkpointing's recompute)."""

    def held(self, step: StepShape, load: RankLoad, m: RankMemory) -> None:
        """Change what a rank holds of its stage (`m.p_gathered`, `m.p_local`; by default the whole
        stage gathered and 1/(dp_shard x cp) of it as the rank's shard). Runs before every memory
        and optimizer term."""

    def rank_memory(self, step: StepShape, load: RankLoad, m: RankMemory) -> None:
        """Add this strategy's bytes to the rank's `m`: the buffers of the strategy that syncs the
        gradients (one of data, FSDP, expert applies), host and disk bytes of offloaded states."""

    def blocking_collectives(self, step: StepShape, load: RankLoad, counts: StepCounts) -> float:
        """Collectives per micro-batch that stop the rank's compute until every peer has joined
        (issued inline in the forward or backward, nothing scheduled around them): each waits for
        the slowest peer (`Link.skew`). Asynchronous ones (gradient buckets, FSDP's prefetched
        units, a pipeline's posted receives) leave the wait to slack in the schedule: 0."""
        return 0.0

    def variants(self, plan: Any, fixed: dict[str, Any], cluster: Cluster) -> list[Any]:
        """Variants of a fitting plan worth estimating too (the search tries them on the plans that
        made the ranking and on each family's best); `cluster` carries its `calibration`."""
        return []

    def notes(self, plan: Any, cluster: Cluster) -> Iterable[str]:
        """What a ranked plan costs beyond its step time (start-up seconds), for the search's notes."""
        return ()

    def once_s(self, plan: Any, cluster: Cluster) -> float:
        """Seconds the plan's choice costs once per run, not per step (compilation); the search
        amortises them over the run's length when it is given."""
        return 0.0

    def penalty(self, plan: Any) -> float:
        """The ranking handicap of the plan's choice (1: none); a plan departing from the plain
        choice (reduced precision, an uneven partition) must earn it."""
        return 1.0

    # helpers --------------------------------------------------------------------------------
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)


def positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def divisors(n: int) -> list[int]:
    import math

    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def braces(values: Iterable[object]) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"
