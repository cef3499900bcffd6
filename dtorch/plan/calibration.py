"""Published training throughputs the cost model is calibrated and judged against.

The rows live in ``benchmarks/published/*.yaml``, one file per source (a paper, a benchmark page),
each with its provenance: URL, table, date, hardware, framework, the metric as published, and the
configuration details the source does not give (``assumed``). Every row fixes a published run's
configuration (model, cluster, Plan, dtype, compile / async-TP where the run used them).

What is fitted, and how it is judged:

- the base matmul efficiency of each device (A100 80GB, H100 SXM at 700 W, H100 96GB at 500 W
  over its power-capped peak, H200, B200, ...), and two global constants of the cost model (GEMM-width
  half point, element-wise passes; `--refit-globals`), minimising the mean squared log error with
  every source weighted alike;
- leave-one-source-out (`loso`): for each source, fit on all the others and report the error on
  the one left out. A device that only the held-out source measured borrows the efficiency fitted
  for its generation's other devices (else the previous generation's); the report says so.

What is described, not fitted: each row's configuration, and per source what its run did that the
cost model prices (`selective:` policy, `compiled`, `async_tp`, `float8_recipe:`, see
`FLOAT8_RECIPES`, `attention_kernel:`). What is taken from public benchmarks, not fitted: the
attention kernels' speeds (benchmarks/published/kernels/attention.yaml).

    python -m dtorch.plan.calibration                   # fit on every source: constants, in-sample errors
    python -m dtorch.plan.calibration --loso            # leave-one-source-out table (< 1 s)
    python -m dtorch.plan.calibration --loso --refit-globals   # also refit the 2 global constants per fold
    python -m benchmarks.bench_calibration              # both LOSO tables -> benchmarks/results/published_loso.*
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from dtorch import env
from dtorch.cluster.load import load_cluster
from dtorch.model.profile import ModelProfile
from dtorch.plan.cost import DEFAULT_CONSTANTS, CostConstants, estimate
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import analytic_profile, get_profile

PUBLISHED_DIR = Path(env.current().published_dir
                     or Path(__file__).resolve().parents[2] / "benchmarks" / "published")
"""Where the published tables are (the repository's benchmarks/published; $DTORCH_PUBLISHED_DIR overrides)."""

GENERATIONS: dict[str, str] = {
    "A100-SXM-80GB": "ampere",
    "H100-SXM-80GB": "hopper",
    "H100-96GB-500W": "hopper",
    "H200-141GB": "hopper",
    "B200-180GB": "blackwell",
}
"""Device name -> generation, for borrowing an efficiency when a device has no other source."""
PREVIOUS_GENERATION = {"blackwell": "hopper", "hopper": "ampere"}


@dataclass(frozen=True)
class Source:
    id: str
    title: str
    url: str
    table: str
    date: str
    hardware: str = ""
    framework: str = ""
    metric: str = "tokens_per_s_per_gpu"
    notes: str = ""
    assumed: str = ""
    float8_recipe: str = ""
    """How the source's float8 runs scale and cast (a key of `FLOAT8_RECIPES`; "" for none)."""
    attention_kernel: str = "fa2"
    """The fused attention kernel the source's flash models ran (`CostConstants.attention_kernel`):
    'fa2' for torch's SDPA (the default), 'cudnn' for Transformer Engine, 'fa3'."""


FLOAT8_RECIPES: dict[str, float] = {
    "te_current_scaling": 0.0,
    "torchao_tensorwise": 1.5,
}
"""Float8 linear-layer speed-up over bf16 that a published run's float8 recipe realises, as the
cost model's `float8_linear_speedup` (0: the device's fp8 / bf16 peak ratio, 2 on Hopper and
Blackwell). Not fitted to the published tables, taken from the recipes' own layer measurements:

- ``torchao_tensorwise``: torchao's Float8Linear with tensor-wise dynamic scaling (torchtitan's
  float8 converter in 2024-25). Its own forward + backward layer benchmark on H100 at Llama-70B
  shapes (pytorch-labs/float8_experimental PR 144, fast accumulation in the forward only) measured
  1.42-1.55x for the large MLP GEMMs, 1.19-1.26x for the attention output and 0.97-0.99x for the
  fused q/k/v projection of a TP-8 shard: about 1.5 where the FLOPs are. The backward GEMMs run
  without fast accumulation (split accumulators on Hopper) and every operand is cast in separate
  passes, so the realised gain is well below the tensor cores' 2x. The cast traffic is still
  priced apart (`cost.float8_cast_bytes_per_token_block`).
- ``te_current_scaling``: Transformer Engine (Megatron-Core), whose casts are fused into the
  kernels that produce the operands: the spec ratio.

Held out, the torchtitan tables with torchao's 1.5 agree with themselves (the bf16 and float8 rows of
torchtitan-2024-12 fit 0.620 and 0.659 with attention priced at flash-attention 2's published speed,
0.620 and 0.616 when it ran at the GEMMs'; with 2x they need 0.620 and 0.496)."""


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    """The Source id."""
    model: str
    cluster: str
    plan: dict
    tokens_per_s_per_gpu: float
    """Published tokens/s per GPU (converted from s/iteration or TFLOP/s where the source gives those)."""
    dtype: str = "bfloat16"
    compiled: bool = False
    async_tp: bool = False
    selective: str = "attention_core"
    """What the run's selective activation checkpointing recomputes (`dtorch.plan.cost.estimate`)."""
    memory_gib: float | None = None
    published: str = ""
    """The number as the source prints it, with its unit."""
    float8_linear_speedup: float = 0.0
    """What the source's float8 recipe realises on the linear layers (`FLOAT8_RECIPES`; 0: the spec ratio)."""
    attention_kernel: str = "fa2"
    """The source's fused attention kernel (`Source.attention_kernel`)."""


def _profile(name: str, d: dict) -> ModelProfile:
    fam, seq = d["family"], int(d["seq"])
    if fam == "llama":
        # the same profile `dtorch plan` uses for the llama presets (the model room's, when present)
        spec = (f"llama:layers={d['layers']},hidden={d['hidden']},heads={d['heads']},kv_heads={d['kv_heads']},"
                f"ffn={d['ffn']},vocab={d['vocab']},seq={seq}")
        return get_profile(spec, seq)
    if fam == "gpt":  # Megatron GPT (2022): biases, learned positions, no flash attention
        return analytic_profile(name, "gpt", layers=d["layers"], hidden=d["hidden"], heads=d["heads"],
                                vocab=d["vocab"], seq_len=seq, flash=d.get("flash", False))
    if fam == "mpt":  # MPT: GPT-style 4h MLP, no biases, tied embeddings, ALiBi, flash attention
        return analytic_profile(name, "mpt", layers=d["layers"], hidden=d["hidden"], heads=d["heads"],
                                vocab=d["vocab"], seq_len=seq, tied=True, flash=True, biases=False)
    raise ValueError(f"unknown model family {fam!r} in the published tables ({name})")


@lru_cache(maxsize=4)
def _load(folder: str) -> tuple[tuple[Source, ...], tuple[Row, ...], tuple[tuple[str, dict], ...]]:
    import yaml

    sources, rows, models = [], [], {}
    for path in sorted(Path(folder).glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        src = Source(id=doc["source"], title=doc["title"], url=doc["url"], table=doc["table"], date=str(doc["date"]),
                     hardware=doc.get("hardware", ""), framework=doc.get("framework", ""),
                     metric=doc.get("metric", "tokens_per_s_per_gpu"), notes=doc.get("notes", ""),
                     assumed=doc.get("assumed", ""), float8_recipe=doc.get("float8_recipe", ""),
                     attention_kernel=doc.get("attention_kernel", "fa2"))
        if src.float8_recipe and src.float8_recipe not in FLOAT8_RECIPES:
            raise ValueError(f"{path.name}: float8_recipe {src.float8_recipe!r} is not one of {sorted(FLOAT8_RECIPES)}")
        sources.append(src)
        for name, spec in (doc.get("models") or {}).items():
            if name in models and models[name] != spec:
                raise ValueError(f"{path.name}: model {name} differs from its definition in another table")
            models[name] = spec
        for r in doc["rows"]:
            plan = {"param_dtype": "bfloat16", "reduce_dtype": "float32", **r["plan"]}
            rows.append((src, r, plan))
    profiles = {n: _profile(n, s) for n, s in models.items()}
    out = []
    for src, r, plan in rows:
        p = Plan(**plan)
        if "tokens_per_s_per_gpu" in r:
            tps, shown = float(r["tokens_per_s_per_gpu"]), f"{r['tokens_per_s_per_gpu']:,} tokens/s/GPU"
        elif "seconds_per_iteration" in r:
            gpus = p.world_size
            tps = p.dp * p.local_batch() * profiles[r["model"]].seq_len / r["seconds_per_iteration"] / gpus
            shown = f"{r['seconds_per_iteration']} s/iteration"
        elif "megatron_tflops_per_gpu" in r:  # Megatron-LM's own count: with full recomputation (2104.04473 eq. 3)
            m = profiles[r["model"]]
            n_l, h, s, v = m.num_layers, m.hidden, m.seq_len, m.vocab_size
            tps = r["megatron_tflops_per_gpu"] * 1e12 / (96 * n_l * h * h * (1 + s / (6 * h) + v / (16 * n_l * h)))
            shown = f"{r['megatron_tflops_per_gpu']} TFLOP/s/GPU (Megatron's count, with recomputation)"
        elif "tflops_per_gpu" in r:
            tps = r["tflops_per_gpu"] * 1e12 / profiles[r["model"]].flops_per_token
            shown = f"{r['tflops_per_gpu']} TFLOP/s/GPU"
        else:
            raise ValueError(f"row {r['name']}: give tokens_per_s_per_gpu, seconds_per_iteration, tflops_per_gpu "
                             "or megatron_tflops_per_gpu")
        out.append(Row(name=r["name"], source=src.id, model=r["model"], cluster=r["cluster"], plan=plan,
                       tokens_per_s_per_gpu=tps, dtype=r.get("dtype", "bfloat16"), compiled=r.get("compiled", False),
                       async_tp=r.get("async_tp", False),
                       selective=r.get("selective", "attention_core"), memory_gib=r.get("memory_gib"), published=shown,
                       float8_linear_speedup=FLOAT8_RECIPES.get(src.float8_recipe, 0.0),
                       attention_kernel=src.attention_kernel))
    return tuple(sources), tuple(out), tuple(sorted(models.items()))


def sources(folder: Path = PUBLISHED_DIR) -> list[Source]:
    return list(_load(str(folder))[0]) if folder.is_dir() else []


def _rows(folder: Path = PUBLISHED_DIR) -> list[Row]:
    return list(_load(str(folder))[1]) if folder.is_dir() else []


ROWS: list[Row] = _rows()


def _models() -> dict[str, ModelProfile]:
    if not PUBLISHED_DIR.is_dir():
        return {}
    return {n: _profile(n, spec) for n, spec in _load(str(PUBLISHED_DIR))[2]}


CALIBRATION_BASE = DEFAULT_CONSTANTS
"""The shipped constants (float8 GEMMs of published float8 runs at the device's fp8 / bf16 peak
ratio, `CostConstants.float8_linear_speedup`, unless the row's source names a float8 recipe:
`FLOAT8_RECIPES`, applied per row by `predict`)."""


@lru_cache(maxsize=256)
def _cluster(spec: str):
    return load_cluster(spec)


def device_of(row: Row) -> str:
    return _cluster(row.cluster).slowest_group().device.name


def predict(row: Row, constants: CostConstants = DEFAULT_CONSTANTS, models: dict | None = None):
    """(predicted tokens/s/GPU, the Estimate) for a row's published configuration."""
    models = models or _models()
    cluster = _cluster(row.cluster)
    plan = Plan(**row.plan)
    plan.validate(cluster.world_size)
    if row.dtype == "float8" and row.float8_linear_speedup:
        constants = replace(constants, float8_linear_speedup=row.float8_linear_speedup)
    if row.attention_kernel != constants.attention_kernel:
        constants = replace(constants, attention_kernel=row.attention_kernel)
    est = estimate(plan, models[row.model], cluster, row.dtype, compiled=row.compiled, async_tp=row.async_tp,
                   selective=row.selective, constants=constants)
    return est.tokens_per_s_per_gpu, est


def errors(constants: CostConstants = DEFAULT_CONSTANTS, rows: list[Row] | None = None) -> list[tuple[Row, float, float]]:
    """(row, predicted TPS/GPU, relative error) for every row."""
    models = _models()
    out = []
    for row in ROWS if rows is None else rows:
        pred, _ = predict(row, constants, models)
        out.append((row, pred, pred / row.tokens_per_s_per_gpu - 1.0))
    return out


# ---- fitting -------------------------------------------------------------------------------------
GRID = [(w, e) for w in (64.0, 128.0, 192.0) for e in (8.0, 12.0, 16.0, 24.0)]
"""(gemm_width_half, elementwise_passes) candidates of the global fit. The exposed share of TP
traffic and the data-parallel overlap are not fitted: TP is exposed unless the run overlaps it
(`async_tp`), and FSDP/DDP transfers hide one unit ahead (`dtorch.plan.comm.prefetched`)."""


def _with(c: CostConstants, effs: dict[str, float]) -> CostConstants:
    return replace(c, device_efficiency=tuple(sorted(effs.items())))


@dataclass
class Fit:
    constants: CostConstants
    efficiencies: dict[str, float]
    """Fitted base matmul efficiency per device name."""
    loss: float
    borrowed: dict[str, str] = field(default_factory=dict)
    """Devices with no training row -> where their efficiency came from."""


def _loss(rows: list[Row], c: CostConstants, models: dict) -> float:
    """Mean over sources of each source's mean squared log error (every source weighs alike)."""
    per: dict[str, list[float]] = {}
    for r in rows:
        per.setdefault(r.source, []).append(math.log(predict(r, c, models)[0] / r.tokens_per_s_per_gpu) ** 2)
    return sum(sum(v) / len(v) for v in per.values()) / max(1, len(per))


def fit(base: CostConstants = CALIBRATION_BASE, rows: list[Row] | None = None, grid=()) -> Fit:
    """Fit per-device base efficiencies (golden-section on each device's rows, log error) for each
    global-constant candidate of `grid` (default: none, keep `base`'s; `GRID` refits them too) and
    keep the best."""
    rows = list(ROWS if rows is None else rows)
    models = _models()
    devices = sorted({device_of(r) for r in rows})
    by_dev = {d: [r for r in rows if device_of(r) == d] for d in devices}
    candidates = list(grid)
    best: Fit | None = None
    for cand in candidates or [None]:
        c = base
        if cand is not None:
            w, e = cand
            c = replace(base, gemm_width_half=w, elementwise_passes=e)
        effs = dict(c.device_efficiency)
        for dev in devices:
            lo, hi = 0.15, 1.0
            for _ in range(28):
                a, b = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
                la = _loss(by_dev[dev], _with(c, {**effs, dev: a}), models)
                lb = _loss(by_dev[dev], _with(c, {**effs, dev: b}), models)
                lo, hi = (lo, b) if la < lb else (a, hi)
            effs[dev] = round((lo + hi) / 2, 4)
        c = _with(c, effs)
        loss = _loss(rows, c, models)
        if best is None or loss < best.loss:
            best = Fit(c, {d: effs[d] for d in devices}, loss)
    return best


def _borrow(f: Fit, device: str) -> tuple[float, str] | None:
    """An efficiency for a device the fit never saw: its generation's fitted devices, else the
    previous generation's (mean)."""
    gen = GENERATIONS.get(device)
    while gen:
        same = [e for d, e in f.efficiencies.items() if GENERATIONS.get(d) == gen]
        if same:
            return sum(same) / len(same), gen
        gen = PREVIOUS_GENERATION.get(gen)
    return None


PRIOR_EFFICIENCY = 0.75
"""The base matmul efficiency every device gets before any fitting: what cuBLAS's large bf16 GEMMs
reach of the spec peak on A100/H100-class parts (70-80 %), the same for every device."""


def prior(devices) -> CostConstants:
    """The cost model before any fitting: `CostConstants`' own defaults (GEMM-width half point 192,
    eight element-wise passes) and `PRIOR_EFFICIENCY` on every device of `devices`."""
    return _with(CostConstants(), {d: PRIOR_EFFICIENCY for d in devices})


@dataclass
class HeldOut:
    source: str
    rows: list[tuple[Row, float, float]]
    """(row, predicted, relative error) with the constants fitted without this source."""
    fit: Fit
    before: list[tuple[Row, float, float]] = field(default_factory=list)
    """(row, predicted, relative error) of the structure before any fitting (`prior`)."""

    @property
    def before_mean_abs(self) -> float:
        return sum(abs(e) for _, _, e in self.before) / len(self.before) if self.before else float("nan")

    @property
    def mean_abs(self) -> float:
        return sum(abs(e) for _, _, e in self.rows) / len(self.rows)

    @property
    def mean_signed(self) -> float:
        return sum(e for _, _, e in self.rows) / len(self.rows)

    @property
    def max_abs(self) -> float:
        return max(abs(e) for _, _, e in self.rows)


def loso(base: CostConstants = CALIBRATION_BASE, rows: list[Row] | None = None, grid=()) -> list[HeldOut]:
    """Leave-one-source-out: for each source, fit on all the other sources' rows (`fit(base, rows,
    grid)`) and predict its rows."""
    rows = list(ROWS if rows is None else rows)
    models = _models()
    out = []
    for src in sorted({r.source for r in rows}):
        train = [r for r in rows if r.source != src]
        held = [r for r in rows if r.source == src]
        f = fit(base, train, grid)
        effs = dict(f.efficiencies)
        for dev in sorted({device_of(r) for r in held} - set(effs)):
            got = _borrow(f, dev)
            if got is None:  # nothing to borrow from: the device preset's own nominal number
                f.borrowed[dev] = "preset"
                continue
            effs[dev], gen = got
            f.borrowed[dev] = f"{gen} fit"
        c = _with(f.constants, effs)
        res = []
        for r in held:
            pred, _ = predict(r, c, models)
            res.append((r, pred, pred / r.tokens_per_s_per_gpu - 1.0))
        out.append(HeldOut(src, res, f, errors(prior({device_of(r) for r in held}), held)))
    return out


# ---- reports -------------------------------------------------------------------------------------
def report(constants: CostConstants | None = None) -> str:
    """Every row against `constants` (default: fitted on every source, i.e. in-sample), per source."""
    constants = constants or fit().constants
    lines = [f"{'row':28s} {'source':22s} {'device':16s} {'published':>10s} {'predicted':>10s} {'error':>7s}"]
    rows = errors(constants)
    for src in sorted({r.source for r, _, _ in rows}):
        errs = []
        for row, pred, err in rows:
            if row.source != src:
                continue
            errs.append(abs(err))
            lines.append(f"{row.name:28s} {src:22s} {device_of(row):16s} {row.tokens_per_s_per_gpu:10.1f} "
                         f"{pred:10.1f} {err:+7.1%}")
        lines.append(f"{'':28s} {src:22s} mean |error| {sum(errs) / len(errs):.1%}, max {max(errs):.1%}")
    return "\n".join(lines)


def loso_table(results: list[HeldOut]) -> str:
    """Markdown: one line per held-out source."""
    lines = ["| held-out source | rows | devices | before fitting | mean abs error | mean signed | max abs | "
             "efficiency borrowed |",
             "|---|---|---|---|---|---|---|---|"]
    for h in results:
        devs = ", ".join(sorted({device_of(r) for r, _, _ in h.rows}))
        borrowed = ", ".join(f"{d} ({w})" for d, w in h.fit.borrowed.items()) or "-"
        lines.append(f"| {h.source} | {len(h.rows)} | {devs} | {h.before_mean_abs:.1%} | {h.mean_abs:.1%} | "
                     f"{h.mean_signed:+.1%} | {h.max_abs:.1%} | {borrowed} |")
    return "\n".join(lines)


def loso_rows_table(results: list[HeldOut]) -> str:
    lines = ["| row | held-out source | published | predicted | error |", "|---|---|---|---|---|"]
    for h in results:
        for r, pred, err in h.rows:
            lines.append(f"| {r.name} | {h.source} | {r.tokens_per_s_per_gpu:,.1f} | {pred:,.1f} | {err:+.1%} |")
    return "\n".join(lines)


def _main(argv: list[str]) -> None:
    grid = GRID if "--refit-globals" in argv else ()
    if "--loso" in argv:
        res = loso(grid=grid)
        print(loso_table(res))
        print()
        print(loso_rows_table(res))
        return
    f = fit(grid=grid)
    c = f.constants
    print(f"fitted on every source: efficiencies {f.efficiencies}; gemm_width_half={c.gemm_width_half} "
          f"elementwise_passes={c.elementwise_passes}; loss {f.loss:.4f}")
    print(report(c))


if __name__ == "__main__":
    _main(sys.argv[1:])
