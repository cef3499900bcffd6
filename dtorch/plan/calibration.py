"""Published training throughputs the cost model is calibrated and checked against.

Rows come from shared/reference/CALIBRATION.md (torchtitan Dec 2024 H100 benchmark, Korthikanti
et al. 2022 on A100, MosaicML llm-foundry on H100). Each row fixes the published configuration;
`split` says whether the row was used to fit the constants ("fit") or only to check them
("held_out"). A model looks good on the rows it was tuned on: report both errors separately.

    python -m dtorch.plan.calibration          # table of predicted vs published, both splits
    python -m dtorch.plan.calibration --fit    # refit the per-device efficiencies on the "fit" rows
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

from dtorch.cluster.load import load_cluster
from dtorch.model.profile import ModelProfile
from dtorch.plan.cost import DEFAULT_CONSTANTS, CostConstants, estimate
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import analytic_profile, get_profile


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, seq: int) -> ModelProfile:
    # the same profile `dtorch plan` uses for the llama presets (the model room's, when present)
    spec = f"llama:layers={layers},hidden={hidden},heads={heads},kv_heads={kv},ffn={ffn},vocab=128256,seq={seq}"
    return get_profile(spec, seq)


def _megatron(name: str, layers: int, hidden: int, heads: int) -> ModelProfile:
    # Korthikanti et al. 2022: GPT, s = 2048, V = 51200, no flash attention (Megatron 2022)
    return analytic_profile(name, "gpt", layers=layers, hidden=hidden, heads=heads, vocab=51200, seq_len=2048,
                            flash=False)


def _mpt(name: str, layers: int, hidden: int, heads: int) -> ModelProfile:
    # llm-foundry MPT: GPT-style 4h MLP, no biases, tied embeddings, ALiBi (no positions), flash attention
    return analytic_profile(name, "mpt", layers=layers, hidden=hidden, heads=heads, vocab=50368, seq_len=2048,
                            tied=True, flash=True, biases=False)


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    model: str
    cluster: str
    plan: dict
    tokens_per_s_per_gpu: float
    """Published tokens/s per GPU (Korthikanti: global batch x s / (s/iter x GPUs))."""
    split: str
    dtype: str = "bfloat16"
    compiled: bool = False
    async_tp: bool = False
    memory_gib: float | None = None


def _models() -> dict[str, ModelProfile]:
    return {
        "llama3.1-8b": _llama("llama3.1-8b", 32, 4096, 32, 8, 14336, 8192),
        "llama3.1-8b-s65536": _llama("llama3.1-8b", 32, 4096, 32, 8, 14336, 65536),
        "llama3.1-70b": _llama("llama3.1-70b", 80, 8192, 64, 8, 28672, 8192),
        "llama3.1-405b": _llama("llama3.1-405b", 126, 16384, 128, 8, 53248, 8192),
        "gpt-22b": _megatron("gpt-22b", 48, 6144, 64),
        "gpt-175b": _megatron("gpt-175b", 96, 12288, 96),
        "gpt-530b": _megatron("gpt-530b", 105, 20480, 128),
        "gpt-1t": _megatron("gpt-1t", 128, 25600, 160),
        "mpt-70b": _mpt("mpt-70b", 80, 8192, 64),
        "mpt-30b": _mpt("mpt-30b", 48, 7168, 64),
        "mpt-13b": _mpt("mpt-13b", 40, 5120, 40),
        "mpt-7b": _mpt("mpt-7b", 32, 4096, 32),
        "mpt-1b": _mpt("mpt-1b", 24, 2048, 16),
    }


TT = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
KO = "Korthikanti et al. 2022, Table 5 / Figure 1"
LF = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"
BF = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


def _ko(gb: int, s_per_iter: float, gpus: int) -> float:
    return gb * 2048 / s_per_iter / gpus


ROWS: list[Row] = [
    # torchtitan, H100 96GB at 500 W (preset h100-96gb), seq 8192 unless stated
    Row("tt-8b-fsdp8", TT, "llama3.1-8b", "h100-96gb:1x8",
        dict(dp_shard=8, microbatch_size=2, ac="selective", **BF), 5762, "fit", memory_gib=82.4),
    Row("tt-8b-fsdp8-compile", TT, "llama3.1-8b", "h100-96gb:1x8",
        dict(dp_shard=8, microbatch_size=2, ac="selective", **BF), 6667, "held_out", compiled=True, memory_gib=77.0),
    Row("tt-8b-fsdp128", TT, "llama3.1-8b", "h100-96gb:16x8",
        dict(dp_shard=128, microbatch_size=2, ac="selective", **BF), 5605, "held_out", memory_gib=67.0),
    Row("tt-8b-fsdp4-cp2-s65536", TT, "llama3.1-8b-s65536", "h100-96gb:1x8",
        dict(dp_shard=4, cp=2, microbatch_size=1, ac="full", **BF), 2540, "held_out",
        dtype="float8", compiled=True, memory_gib=84.2),
    Row("tt-70b-fsdp32-tp8", TT, "llama3.1-70b", "h100-96gb:32x8",
        dict(dp_shard=32, tp=8, sp=True, microbatch_size=16, ac="full", **BF), 829, "fit",
        dtype="float8", compiled=True, memory_gib=71.9),
    Row("tt-70b-fsdp32-tp8-asynctp", TT, "llama3.1-70b", "h100-96gb:32x8",
        dict(dp_shard=32, tp=8, sp=True, microbatch_size=16, ac="full", **BF), 876, "held_out",
        dtype="float8", compiled=True, async_tp=True, memory_gib=67.6),
    Row("tt-405b-3d-1f1b", TT, "llama3.1-405b", "h100-96gb:64x8",
        dict(dp_shard=8, tp=8, sp=True, pp=8, microbatch_size=1, num_microbatches=32, schedule="1f1b",
             ac="full", reshard_after_forward=False, **BF), 100, "held_out",
        dtype="float8", compiled=True, async_tp=True, memory_gib=82.5),
    Row("tt-405b-3d-interleaved", TT, "llama3.1-405b", "h100-96gb:64x8",
        dict(dp_shard=8, tp=8, sp=True, pp=8, microbatch_size=1, num_microbatches=32,
             schedule="interleaved_1f1b", virtual_stages=2, ac="full", reshard_after_forward=False, **BF),
        128, "fit", dtype="float8", compiled=True, async_tp=True, memory_gib=72.7),
    # Korthikanti et al. 2022, A100 80GB, s = 2048, dp = 1 (TP x PP = GPUs)
    Row("ko-22b-sel", KO, "gpt-22b", "a100:1x8",
        dict(tp=8, sp=True, microbatch_size=4, num_microbatches=1, ac="selective", **BF), _ko(4, 1.10, 8), "fit"),
    Row("ko-175b-sel", KO, "gpt-175b", "a100:8x8",
        dict(tp=8, sp=True, pp=8, microbatch_size=1, num_microbatches=64, schedule="interleaved_1f1b",
             virtual_stages=3, ac="selective", **BF), _ko(64, 13.75, 64), "fit"),
    Row("ko-530b-sel", KO, "gpt-530b", "a100:35x8",
        dict(tp=8, sp=True, pp=35, microbatch_size=1, num_microbatches=280, schedule="interleaved_1f1b",
             virtual_stages=3, ac="selective", **BF), _ko(280, 37.83, 280), "held_out"),
    Row("ko-1t-sel", KO, "gpt-1t", "a100:64x8",
        dict(tp=8, sp=True, pp=64, microbatch_size=1, num_microbatches=512, schedule="1f1b",
             ac="selective", **BF), _ko(512, 71.49, 512), "fit"),
    Row("ko-22b-full", KO, "gpt-22b", "a100:1x8",
        dict(tp=8, sp=True, microbatch_size=4, num_microbatches=1, ac="full", **BF), _ko(4, 1.42, 8), "held_out"),
    Row("ko-175b-full", KO, "gpt-175b", "a100:8x8",
        dict(tp=8, sp=True, pp=8, microbatch_size=1, num_microbatches=64, schedule="interleaved_1f1b",
             virtual_stages=3, ac="full", **BF), _ko(64, 18.13, 64), "held_out"),
    Row("ko-530b-full", KO, "gpt-530b", "a100:35x8",
        dict(tp=8, sp=True, pp=35, microbatch_size=1, num_microbatches=280, schedule="interleaved_1f1b",
             virtual_stages=3, ac="full", **BF), _ko(280, 49.05, 280), "held_out"),
    Row("ko-1t-full", KO, "gpt-1t", "a100:64x8",
        dict(tp=8, sp=True, pp=64, microbatch_size=1, num_microbatches=512, schedule="1f1b",
             ac="full", **BF), _ko(512, 94.42, 512), "held_out"),
    # llm-foundry, H100 80GB SXM, pure FSDP, seq 2048 ("AC yes" = full activation checkpointing)
    Row("lf-70b", LF, "mpt-70b", "h100:8x8",
        dict(dp_shard=64, microbatch_size=8, num_microbatches=4, ac="full", **BF), 1039, "fit"),
    Row("lf-30b", LF, "mpt-30b", "h100:1x8",
        dict(dp_shard=8, microbatch_size=3, num_microbatches=21, ac="full", **BF), 2002, "held_out"),
    Row("lf-13b", LF, "mpt-13b", "h100:1x8",
        dict(dp_shard=8, microbatch_size=2, num_microbatches=1, **BF), 4792, "fit"),
    Row("lf-7b", LF, "mpt-7b", "h100:1x8",
        dict(dp_shard=8, microbatch_size=6, num_microbatches=1, **BF), 10643, "held_out"),
    Row("lf-1b", LF, "mpt-1b", "h100:8x8",
        dict(dp_shard=64, microbatch_size=20, num_microbatches=1, **BF), 44402, "fit"),
]


def predict(row: Row, constants: CostConstants = DEFAULT_CONSTANTS, models: dict | None = None):
    """(predicted tokens/s/GPU, the Estimate) for a row's published configuration."""
    models = models or _models()
    profile = models[row.model]
    cluster = load_cluster(row.cluster)
    plan = Plan(**row.plan)
    plan.validate(cluster.world_size)
    est = estimate(plan, profile, cluster, row.dtype, compiled=row.compiled, async_tp=row.async_tp,
                   constants=constants)
    return est.tokens_per_s_per_gpu, est


def errors(constants: CostConstants = DEFAULT_CONSTANTS) -> list[tuple[Row, float, float]]:
    """(row, predicted TPS/GPU, relative error) for every row."""
    models = _models()
    out = []
    for row in ROWS:
        pred, _ = predict(row, constants, models)
        out.append((row, pred, pred / row.tokens_per_s_per_gpu - 1.0))
    return out


def fit(base: CostConstants = DEFAULT_CONSTANTS) -> CostConstants:
    """Fit the base matmul efficiency of each device on the "fit" rows (least squares of log error,
    golden-section per device) for a few GEMM-width constants; keep the best."""
    models = _models()
    fit_rows = [r for r in ROWS if r.split == "fit"]
    devices = sorted({load_cluster(r.cluster).slowest_group().device.name for r in fit_rows})

    def loss_for(c: CostConstants, dev: str) -> float:
        rs = [r for r in fit_rows if load_cluster(r.cluster).slowest_group().device.name == dev]
        return sum(math.log(predict(r, c, models)[0] / r.tokens_per_s_per_gpu) ** 2 for r in rs)

    best = None
    grid = [(w, e, t, f) for w in (64.0, 128.0) for e in (8.0, 12.0, 16.0) for t in (0.5, 0.75)
            for f in (0.0, 0.2, 0.4)]
    for width_half, passes, tp_exposed, floor in grid:
        c = replace(base, gemm_width_half=width_half, elementwise_passes=passes, tp_exposed=tp_exposed,
                    dp_exposed_floor=floor)
        effs = dict(c.device_efficiency)
        total = 0.0
        for dev in devices:
            lo, hi = 0.2, 1.0
            for _ in range(40):
                a, b = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
                la = loss_for(replace(c, device_efficiency=tuple({**effs, dev: a}.items())), dev)
                lb = loss_for(replace(c, device_efficiency=tuple({**effs, dev: b}.items())), dev)
                lo, hi = (lo, b) if la < lb else (a, hi)
            effs[dev] = round((lo + hi) / 2, 4)
            c = replace(c, device_efficiency=tuple(sorted(effs.items())))
            total += loss_for(c, dev)
        if best is None or total < best[0]:
            best = (total, c)
    return best[1]


def report(constants: CostConstants = DEFAULT_CONSTANTS) -> str:
    lines = [f"{'row':32s} {'split':9s} {'published':>10s} {'predicted':>10s} {'error':>7s}"]
    rows = errors(constants)
    for split in ("fit", "held_out"):
        errs = []
        for row, pred, err in rows:
            if row.split != split:
                continue
            errs.append(abs(err))
            lines.append(f"{row.name:32s} {split:9s} {row.tokens_per_s_per_gpu:10.1f} {pred:10.1f} {err:+7.1%}")
        lines.append(f"{'':32s} {split:9s} mean |error| {sum(errs) / len(errs):.1%}, max {max(errs):.1%}")
    return "\n".join(lines)


if __name__ == "__main__":
    c = DEFAULT_CONSTANTS
    if "--fit" in sys.argv:
        c = fit()
        print("fitted:", c)
    print(report(c))
