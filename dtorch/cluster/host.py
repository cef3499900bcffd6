"""Measure what the host optimizer tier costs on this host: torch's CPU AdamW, and the copies
between device and host memory.

    from dtorch.cluster.host import measure_host_optimizer
    measure_host_optimizer()   # {"adam_fused_params_per_s": ..., "adam_loop_params_per_s": ..., ...}

`dtorch probe` runs it on every rank at once (the ranks of a node share its cores and memory, as
they do when they all step on the CPU), and the planner prices `offload=optimizer` with it
(`apply_calibration` sets the node group's `host_adam_*` and `host_link_bytes_per_s`).

Why measured and not derived from the memory bandwidth: on the development machine the fused
kernel stepped 1.2e9 parameters/s, 34 GB/s of Adam traffic against a 14-16 GB/s tensor copy, and
torch's default CPU kernel (a per-tensor loop) ten times fewer; neither is "28 bytes at 80 % of
the copy bandwidth", the rule the cost model used before.
"""

from __future__ import annotations

from typing import Any

from dtorch.cluster.timing import timeit


def _rate(fn, work: float, min_time: float, device: Any = None) -> float:
    """`work` per second of `fn`: the probe's timing (the median of three blocks of back-to-back
    calls, each at least `min_time`; the throughput a rank gets, descheduled time included)."""
    import torch

    return work / timeit(fn, device if device is not None else torch.device("cpu"), min_time=min_time)


def measure_host_optimizer(numel: int = 16 * 2**20, min_time: float = 0.1, device: Any = None) -> dict:
    """Parameters per second of torch's CPU AdamW over `numel` float32 parameters (in four
    tensors, fused kernel and the default per-tensor loop), the bytes per second (read + written) of
    copying them between host tensors, and on CUDA of pinned host <-> device copies (`device`: the
    rank's accelerator; None = none)."""
    import torch

    n = max(4, int(numel)) // 4
    out: dict[str, float] = {"numel": 4 * n}
    for name, fused in (("adam_fused_params_per_s", True), ("adam_loop_params_per_s", None)):
        params = [torch.nn.Parameter(torch.randn(n)) for _ in range(4)]
        for p in params:
            p.grad = torch.randn(n)
        kw = {"fused": True} if fused else {}
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kw)
        out[name] = _rate(opt.step, 4.0 * n, min_time if fused else min_time / 4)  # (the loop: ~10x slower)
    # the tier's copies on a CPU: parameter-sized tensors into other tensors, a model's worth at a
    # time (more than a cache holds), each byte read and written (the probe's memory-bandwidth unit)
    m = max(n, 4 * 2**20)  # 4 x 16 MiB at least: twice the development machine's 32 MiB L3
    src = [torch.randn(m) for _ in range(4)]
    dst = [torch.empty(m) for _ in range(4)]

    def copy_all():
        for a, b in zip(src, dst):
            b.copy_(a)

    out["copy_bytes_per_s"] = _rate(copy_all, 2.0 * 4 * 4 * m, min_time)
    if device is not None and getattr(device, "type", str(device)) == "cuda":
        host = torch.empty(4 * n, dtype=torch.float32, pin_memory=True)
        dev = torch.empty(4 * n, dtype=torch.float32, device=device)
        nbytes = 4.0 * 4 * n

        out["h2d_bytes_per_s"] = _rate(lambda: dev.copy_(host, non_blocking=True), nbytes, min_time, device)
        out["d2h_bytes_per_s"] = _rate(lambda: host.copy_(dev, non_blocking=True), nbytes, min_time, device)
    return out


def summary(doc: dict) -> str:
    line = (f"host optimizer: AdamW {doc['adam_fused_params_per_s'] / 1e6:,.0f} M params/s fused, "
            f"{doc['adam_loop_params_per_s'] / 1e6:,.0f} M params/s default kernel")
    if "copy_bytes_per_s" in doc:
        line += f"; host copies {doc['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + write)"
    if "h2d_bytes_per_s" in doc:
        line += (f"; pinned copies {doc['h2d_bytes_per_s'] / 1e9:.1f} GB/s host->device, "
                 f"{doc['d2h_bytes_per_s'] / 1e9:.1f} GB/s device->host")
    return line
