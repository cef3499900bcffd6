"""MFU has one definition (`dtorch.cluster.peak`): model FLOPs per token (6N + attention, no
recompute) x tokens/s over the device's peak in the compute dtype x devices. On a CPU the peak is
detected from its features, so it bounds what the CPU can compute, and the main job's MFU stays
at most 100 %; the plan, the console line, metrics.jsonl, the per-rank records and the report all
divide by the same number."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys

import pytest

from dtorch.cluster.peak import (
    compute_dtype,
    cpu_clock_ghz,
    cpu_peak,
    flops_per_cycle,
    node_cpus,
    physical_cores,
)

SPR = {"fma", "avx", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"}


def test_cpu_peak_is_cores_times_clock_times_flops_per_cycle_per_dtype():
    peak = cpu_peak("float32", flags=SPR, cores=2, ghz=2.6)
    assert peak.flops == pytest.approx(2 * 2.6e9 * 64)  # 16 fp32 lanes x FMA (2) x 2 units
    assert cpu_peak("bfloat16", flags=SPR, cores=2, ghz=2.6).flops == pytest.approx(2 * 2.6e9 * 1024)  # AMX
    no_amx = SPR - {"amx_bf16"}
    assert cpu_peak("bfloat16", flags=no_amx, cores=2, ghz=2.6).flops == pytest.approx(2 * 2.6e9 * 128)
    assert cpu_peak("float16", flags=SPR, cores=1, ghz=1.0).flops == pytest.approx(1e9 * 128)
    avx2 = {"fma", "avx", "avx2"}
    assert flops_per_cycle("float32", avx2) == (32.0, "AVX2 FMA x 2")
    per, what = flops_per_cycle("bfloat16", avx2)  # no bf16 instructions: computed in float32
    assert per == 32.0 and "emulated" in what
    assert flops_per_cycle("float32", {"avx512f"}, half_width_avx512=True)[0] == 32.0  # AMD Zen 4
    assert "2 cores x 2.60 GHz" in peak.describe() and "332.8 GFLOP/s float32" in peak.describe()


def test_hyperthreads_count_once_and_only_the_containers_cpus(tmp_path):
    info = [{"processor": str(i), "physical id": "0", "core id": str(i % 4)} for i in range(8)]  # 4 cores x 2 threads
    assert physical_cores(info, allowed=set(range(8))) == 4
    assert physical_cores(info, allowed={0, 4}) == 1  # two threads of core 0
    assert physical_cores(info, allowed={0, 1}) == 2
    cpuset = tmp_path / "cpuset.cpus.effective"
    cpuset.write_text("0-1,4\n")
    assert node_cpus((str(tmp_path / "missing"), str(cpuset))) == {0, 1, 4}
    assert node_cpus((str(tmp_path / "missing"),)) is None  # outside a container: every CPU


def test_the_clock_is_the_highest_the_cores_may_run_at(tmp_path):
    max_freq = tmp_path / "cpuinfo_max_freq"
    max_freq.write_text("3800000\n")  # kHz: the turbo clock wins over the nominal one
    info = [{"model name": "Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz", "cpu mhz": "1200.000"}]
    assert cpu_clock_ghz(info, str(max_freq)) == (pytest.approx(3.8), "cpuinfo_max_freq")
    assert cpu_clock_ghz(info, str(tmp_path / "none")) == (pytest.approx(2.5), "model name")
    vm = [{"model name": "Intel(R) Xeon(R) Processor", "cpu mhz": "2600.000"}, {"cpu mhz": "2400.0"}]
    assert cpu_clock_ghz(vm, str(tmp_path / "none")) == (pytest.approx(2.6), "cpu MHz")


def test_the_detected_peak_bounds_what_a_gemm_reaches_on_this_cpu():
    """A measured rate is no peak (MFU against one read 91-104 %): the detected peak must be above
    the best a large GEMM reaches here with every core (within the turbo a VM's nominal clock hides)."""
    import torch

    from dtorch.monitor.metrics import measured_gemm_rate

    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        best = max(measured_gemm_rate(torch.device("cpu"), torch.float32, 512) for _ in range(3))
    finally:
        torch.set_num_threads(threads)
    peak = cpu_peak("float32")
    if peak.clock_source != "cpuinfo_max_freq":
        # without cpufreq the clock is a base one (the model name's, a VM's nominal "cpu MHz") and the
        # cores may turbo above it (peak.py's documented exception: a GEMM here reached 2.75 GHz's
        # worth over a reported 2.60); server parts' highest turbo is under twice their base clock
        assert 0 < best <= 2 * peak.flops, (best, peak.describe())
    else:
        assert 0 < best <= peak.flops, (best, peak.describe())


def test_the_plan_divides_by_the_detected_peak_shared_by_the_ranks_of_a_node():
    from dtorch.cluster import local_cluster
    from dtorch.plan.cost import mfu
    from dtorch.plan.profiles import get_profile

    cluster = local_cluster(2, 2, calibrated=False)
    dev = cluster.slowest_group().device
    assert dev.mfu_peak("float32") == pytest.approx(cpu_peak("float32").flops / 2)
    assert dev.mfu_peak("float32") != dev.peak("float32")  # the cost model's figure is another one
    from dtorch.cluster.load import cluster_from_dict, cluster_to_dict

    saved = cluster_from_dict(cluster_to_dict(cluster))  # a cluster file keeps it (`dtorch probe --cluster-out`)
    assert saved.slowest_group().device.mfu_peak("float32") == dev.mfu_peak("float32")
    prof = get_profile("gpt:layers=4,hidden=128,heads=4,vocab=256,seq=256", 128)
    assert mfu(1000.0, prof, cluster, "float32") == pytest.approx(1000.0 * prof.flops_per_token / cpu_peak("float32").flops)


def _console_peak(dtype: str, ranks: int) -> float:
    """What the trainer's console line divides by for one rank of `ranks` on this machine."""
    from types import SimpleNamespace

    import torch

    from dtorch.train.build import device_peak

    tr = SimpleNamespace(plan=SimpleNamespace(param_dtype=dtype), device=torch.device("cpu"), world=ranks,
                         env=SimpleNamespace(local_world_size=ranks))
    return device_peak(tr)


def test_the_cpu_preset_divides_by_the_same_rule_and_the_plan_says_which_cpu(capsys):
    """The `cpu` preset (`--cluster cpu:N`) is a nominal socket, not this machine: its MFU peak is
    `dtorch.cluster.peak`'s rule over the socket's cores, clock and flags, kept apart from the cost
    model's figures (a calibration replaces those with measured rates, which are no peak); the plan
    divides by it, and its MFU line names that socket and what a run on this machine (the console)
    divides by instead. On this machine's detected cluster, plan and console divide by the same."""
    from dtorch.cli import main
    from dtorch.cluster import local_cluster
    from dtorch.cluster.calibration_store import apply_calibration
    from dtorch.cluster.load import parse_shorthand
    from dtorch.cluster.presets import CPU_SOCKET, DEVICES
    from dtorch.plan.cost import mfu
    from dtorch.plan.profiles import get_profile

    socket = {d: cpu_peak(d, flags=set(CPU_SOCKET["flags"]), cores=CPU_SOCKET["cores"], ghz=CPU_SOCKET["ghz"],
                          cpuinfo=[], clock_source="nominal") for d in ("float32", "bfloat16", "float16")}
    assert socket["float32"].flops == pytest.approx(16 * 2.5e9 * 32)  # two 8-wide FMA units per core
    for d, peak in socket.items():
        assert DEVICES["cpu"].mfu_peak(d) == peak.flops

    prof = get_profile("gpt:layers=4,hidden=128,heads=4,vocab=256,seq=256", 128)
    preset = parse_shorthand("cpu:1x2")
    calibrated = apply_calibration(preset, {"device": {"peak_flops": {"float32": 3e11}}})
    assert calibrated.slowest_group().device.peak("float32") == 3e11  # the cost model's figure moved...
    for c in (preset, calibrated):  # ...MFU's peak did not
        assert mfu(1000.0, prof, c, "float32") == pytest.approx(1000.0 * prof.flops_per_token / (2 * socket["float32"].flops))

    # this machine: the plan's peak is the console's
    here = local_cluster(2, 2, calibrated=False).slowest_group().device
    for d in ("float32", "bfloat16"):
        assert here.mfu_peak(d) == pytest.approx(_console_peak(d, 2))

    capsys.readouterr()
    assert main(["plan", "--model", "llama-tiny", "--cluster", "cpu:1x2", "--seq-len", "128"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("MFU:"))
    dtype = re.search(r"GFLOP/s (\w+) per device", line).group(1)
    assert (f"over {socket[dtype].flops / 1e9:,.1f} GFLOP/s {dtype} per device, the cpu preset's nominal socket "
            f"by the same rule: {socket[dtype].describe()}; not this machine's CPU") in line, line
    assert f"a run here divides by {_console_peak(dtype, 2) / 1e9:,.1f} GFLOP/s per rank" in line, line
    assert "spec sheet" not in line


def test_predicted_memory_shows_the_reserve_apart():
    from dtorch.plan.explain import memory_parts, memory_summary

    b = {"params": 3 * 2**20, "grads": 3 * 2**20, "optimizer": 6 * 2**20, "activations": 20 * 2**20,
         "buffers": 50 * 2**20, "margin": 2 * 2**30}
    assert memory_parts(b) == {"model_states": 12 * 2**20, "activations": 20 * 2**20, "buffers": 50 * 2**20,
                               "reserve": 2 * 2**30}
    text = memory_summary(b)
    assert text.startswith("model states 12.0 MiB (params 3.0 MiB, grads 3.0 MiB, optimizer 6.0 MiB) + "
                           "activations 20.0 MiB + buffers 50.0 MiB = 82.0 MiB; reserve 2.0 GiB apart")


@pytest.mark.slow
def test_the_main_job_reports_one_mfu_at_most_100_percent_in_plan_console_log_and_report(tmp_path):
    """`dtorch train` with its defaults (the README's first command), a few steps: the plan's
    predicted MFU, each console line, each step of metrics.jsonl, the per-rank records and the
    report divide model FLOPs by the same peak (the detected CPU peak shared by the ranks), and
    none is above 100 %."""
    run = tmp_path / "run"
    env = {**os.environ, "DTORCH_NO_CALIBRATION": "1", "DTORCH_CAPABILITY_CACHE": str(tmp_path / "cap.json"),
           "DTORCH_METRICS_EVERY": "3"}
    # (the hang watchdog off: on a loaded test machine a slow start would be retried, its steps logged twice)
    proc = subprocess.run([sys.executable, "-m", "dtorch.cli", "train", "--steps", "6", "--sample-tokens", "0",
                           "--checkpoint-dir", str(run), "--heartbeat-timeout", "0", "--max-restarts", "0"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    plan = next(r for r in recs if r.get("event") == "plan")
    steps = [r for r in recs if "event" not in r and "mfu" in r]
    world, peak, fpt = plan["world_size"], plan["mfu_peak_flops"], plan["flops_per_token"]
    assert world == 2 and len(steps) == 6

    # the plan: the same formula over the same peak, which is the detected one of the plan's compute
    # dtype shared by 2 ranks (the search picks bfloat16 where this CPU measured it faster: AMX)
    manifest = json.loads(next(run.glob("step-*/manifest.json")).read_text())["manifest"]
    dtype = compute_dtype(manifest["plan"]["param_dtype"])
    assert peak == pytest.approx(cpu_peak(dtype).flops / 2)
    assert plan["predicted_mfu"] == pytest.approx(plan["predicted_tokens_per_s"] * fpt / (peak * world))
    assert plan["predicted_mfu"] == pytest.approx(manifest["plan"]["predicted"]["mfu"])  # the planner's own figure
    # metrics.jsonl: every step
    for s in steps:
        assert s["mfu"] == pytest.approx(s["tokens_per_s"] * fpt / (peak * world))
        assert 0 < s["mfu"] <= 1.0
    # the per-rank records (the live page and Prometheus' dtorch_mfu_ratio)
    windows = [r for r in recs if r.get("event") == "ranks"]
    assert windows
    for w in windows:
        for r in w["ranks"]:
            assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / (peak * world)) and r["mfu"] <= 1.0
    # the console: the plan line and each progress line show the same figures
    out = proc.stdout + proc.stderr
    assert f"MFU {plan['predicted_mfu']:.1%}" in out and "reserve" in out and "apart" in out, out[-3000:]
    shown = [float(x) for x in re.findall(r"mfu (\d+\.\d)%", out)]
    assert shown == [pytest.approx(100 * s["mfu"], abs=0.051) for s in steps], out[-3000:]
    # the report
    from dtorch.monitor.report import load_run, summarize, write_report

    summary = summarize(load_run(run))
    assert summary["median_mfu"] == pytest.approx(statistics.median(s["mfu"] for s in steps[3:]))
    assert summary["mfu_peak_flops"] == peak and summary["predicted_mfu"] == plan["predicted_mfu"]
    html = write_report(run, tmp_path / "report").read_text()
    assert f"{100 * summary['median_mfu']:.1f} % (plan: {100 * plan['predicted_mfu']:.1f} %)" in html
    assert f"over 2 x {peak / 1e9:,.1f} GFLOP/s peak" in html
    assert "reserve" in html
