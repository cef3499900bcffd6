"""GPU health through NVML (`nvidia-ml-py`, optional: ``pip install dtorch-os[gpu]``).

`sample(index)` returns utilisation (%), temperature (C), SM clock (MHz), power (W) and the active
clock-throttle reasons of one device, or None when NVML or the device is not there (CPU machines,
the package not installed). Called every N steps by the rank collector, never inside a step.
"""

from __future__ import annotations

from typing import Any

_nvml: Any = None
_failed = False

# Throttle-reason bits (nvml.h, nvmlClocksEventReasons); "idle" and "application clocks" are not
# throttling and are not reported.
THROTTLE_BITS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}


def throttle_names(mask: int) -> list[str]:
    """The throttle reasons set in an NVML reasons bitmask."""
    return [name for bit, name in THROTTLE_BITS.items() if mask & bit]


def _init() -> Any:
    global _nvml, _failed
    if _nvml is not None or _failed:
        return _nvml
    try:
        import pynvml  # provided by nvidia-ml-py

        pynvml.nvmlInit()
        _nvml = pynvml
    except Exception:  # noqa: BLE001 - no NVML: no GPU health, nothing else changes
        _failed = True
    return _nvml


def sample(index: int) -> dict[str, float] | None:
    nv = _init()
    if nv is None:
        return None
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
        util = nv.nvmlDeviceGetUtilizationRates(h)
        out = {
            "gpu_util": float(util.gpu),
            "gpu_temp_c": float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            "gpu_sm_clock_mhz": float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            "gpu_power_w": float(nv.nvmlDeviceGetPowerUsage(h)) / 1000.0,
        }
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        out["gpu_throttle_mask"] = float(int(reasons(h)))
        return out
    except Exception:  # noqa: BLE001 - a query the driver does not support: skip this sample
        return None
