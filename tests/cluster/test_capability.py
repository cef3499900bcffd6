"""Precision by hardware: CPU flags decide what is native, a sub-second measurement what is fast."""

from __future__ import annotations

import json

import pytest

from dtorch.cluster import capability
from dtorch.cluster.capability import cpu_dtype_support, measure_speeds, measured, nominal_ratios


def test_flags_tell_native_from_emulated_16_bit_arithmetic():
    avx2 = {"avx", "avx2", "fma", "f16c"}
    assert cpu_dtype_support(avx2) == {"float32": "native", "bfloat16": "emulated", "float16": "emulated"}
    assert cpu_dtype_support(avx2 | {"avx512f", "avx512_bf16"})["bfloat16"] == "dot"
    assert cpu_dtype_support(avx2 | {"amx_bf16", "avx512_bf16", "amx_fp16"}) == {
        "float32": "native", "bfloat16": "matrix", "float16": "matrix"}
    assert cpu_dtype_support({"fp", "asimd", "bf16", "asimdhp"}) == {  # aarch64 feature names
        "float32": "native", "bfloat16": "dot", "float16": "dot"}
    # emulation is priced as what it is: ~20x slower than float32
    assert nominal_ratios(avx2)["bfloat16"] < 0.1 and nominal_ratios(avx2)["float32"] == 1.0


def test_measured_speeds_are_relative_to_float32_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(capability.ENV_CACHE, str(tmp_path / "cap.json"))
    speeds = measure_speeds(1, (64, 4, 32), rounds=2)
    assert speeds["float32"] == 1.0 and all(v > 0 for v in speeds.values())
    first = measured(1, (64, 4, 32))
    doc = json.loads((tmp_path / "cap.json").read_text())
    (entry,) = doc.values()
    assert entry["workload"] == [64, 4, 32] and entry["speed"] == first
    # a second call reads the cache: plan and train on one machine see the same numbers
    monkeypatch.setattr(capability, "measure_speeds", lambda *a, **k: pytest.fail("measured twice"))
    assert measured(1, (64, 4, 32)) == first


def test_a_corrupt_cache_is_measured_again(tmp_path, monkeypatch):
    path = tmp_path / "cap.json"
    path.write_bytes(b"\xff\xfe not json")
    monkeypatch.setenv(capability.ENV_CACHE, str(path))
    assert measured(1, (32, 2, 16))["float32"] == 1.0
    assert json.loads(path.read_text())
