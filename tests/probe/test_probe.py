"""dtorch probe: the calibration file it writes is valid, read back, merged over the nominal
cluster, and changes the planner's estimate; a damaged file is reported or ignored, never trusted."""

from __future__ import annotations

import json

import pytest

from dtorch.cluster import load_cluster, local_cluster
from dtorch.cluster.calibration_store import validate_calibration
from dtorch.cluster.probe import (
    CALIBRATION_VERSION,
    apply_calibration,
    calibration_path,
    collective_steps,
    fit_alpha_beta,
    fit_gemm_efficiency,
    read_calibration,
    run_probe,
    stored_calibration,
    write_calibration,
)
from dtorch.errors import ConfigError
from dtorch.plan.cost import estimate, shape_factor, step_counts, step_shape
from dtorch.plan.plan import Plan
from dtorch.plan.profiles import get_profile


@pytest.fixture
def cal_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DTORCH_CALIBRATION_DIR", str(tmp_path))
    monkeypatch.delenv("DTORCH_NO_CALIBRATION", raising=False)
    return tmp_path


def _doc(cluster: str, peak: float = 1e10, eff: float = 0.5, bw: float = 1e9, lat: float = 1e-4) -> dict:
    return {"version": CALIBRATION_VERSION, "cluster": cluster, "device_kind": "cpu",
            "device": {"peak_flops": {"float32": peak}, "matmul_efficiency": eff, "memory_bandwidth": 2e9},
            "links": {"intra": {"kind": "shm", "bandwidth": bw, "latency": lat, "efficiency": 1.0}}}


def test_single_process_probe_writes_calibration_that_detect_reads_back_and_changes_the_estimate(cal_dir, monkeypatch):
    doc, path = run_probe(1, quick=True, dtypes=["float32"])
    assert path == calibration_path("local:1x1") and path.is_file()
    back = read_calibration(path)
    assert back["device"]["peak_flops"]["float32"] == pytest.approx(doc["device"]["peak_flops"]["float32"])
    assert 0 < back["device"]["matmul_efficiency"] <= 1
    assert len(back["gemm"]) >= 4 and all(r["flops"] > 0 for r in back["gemm"])

    # the attention kernel at every probed shape, read back into the device the planner sees
    assert {(r["head_dim"], r["seq"]) for r in back["attention"]} == {(d, s) for d in (16, 64, 128) for s in (128, 512)}
    assert all(r["flops"] > 0 and r["dtype"] == "float32" for r in back["attention"])
    one = back["attention"][0]
    assert local_cluster(1).groups[0].device.attention_speed("float32", one["head_dim"], one["seq"]) == \
        pytest.approx(one["flops"])

    # host time per operator of a small eager training step, and an empty op's dispatch: both timed
    # with the contention the rank meets (descheduling included, `timing.timeit`), so on a loaded
    # machine either can come out larger; each is a positive time under a millisecond
    assert 0 < back["op_overhead_s"] < 1e-3 and 0 < back["dispatch_overhead_s"] < 1e-3
    assert back["dtensor_op_overhead_s"] == 0.0  # one process: no mesh to put DTensors on

    cal = local_cluster(1)
    assert cal.groups[0].device.op_overhead_s == pytest.approx(back["op_overhead_s"])
    # the host optimizer tier's figures: torch's CPU AdamW (both kernels), read back into the group
    host = back["host_optimizer"]
    assert host["adam_fused_params_per_s"] > 0 and host["adam_loop_params_per_s"] > 0
    assert cal.groups[0].host_adam_params_per_s == pytest.approx(host["adam_fused_params_per_s"])
    assert cal.groups[0].host_link_bytes_per_s == pytest.approx(host["copy_bytes_per_s"] / 2)  # a CPU's copies
    monkeypatch.setenv("DTORCH_NO_CALIBRATION", "1")
    nominal = local_cluster(1)
    dev = cal.groups[0].device
    assert dev.peak("float32") == pytest.approx(back["device"]["peak_flops"]["float32"])
    assert dev.memory_bandwidth == pytest.approx(back["device"]["memory_bandwidth"])
    assert cal.calibration["cluster"] == "local:1x1"
    prof = get_profile("llama-tiny", 128)
    plan = Plan(microbatch_size=4, param_dtype="float32")
    t_cal = estimate(plan, prof, cal, "float32").step_time_s
    t_nom = estimate(plan, prof, nominal, "float32").step_time_s
    assert t_cal != pytest.approx(t_nom, rel=1e-3)


def test_local_cluster_merges_stored_links_and_device_over_the_nominal_ones(cal_dir):
    nominal = local_cluster(4, calibrated=False)
    write_calibration(_doc("local:1x4", peak=3e10, eff=0.4, bw=5e8, lat=2e-4), calibration_path("local:1x4"))
    cal = local_cluster(4)
    g = cal.groups[0]
    assert g.device.peak("float32") == 3e10 and g.device.matmul_efficiency == 0.4
    assert g.intra.bandwidth == 5e8 and g.intra.latency == 2e-4 and g.intra.efficiency == 1.0
    # the preset's other dtypes and the memory capacity are kept: merged, not replaced
    assert g.device.peak("bfloat16") == nominal.groups[0].device.peak("bfloat16")
    assert g.device.memory_bytes == nominal.groups[0].device.memory_bytes
    # more ranks per node is another cluster: not calibrated by this file
    assert local_cluster(2).groups[0].device.peak("float32") == local_cluster(2, calibrated=False).groups[0].device.peak("float32")
    prof = get_profile("llama-tiny", 128)
    plan = Plan(tp=2, dp_shard=2, sp=True, microbatch_size=2, param_dtype="float32")
    e_cal, e_nom = estimate(plan, prof, cal, "float32"), estimate(plan, prof, nominal, "float32")
    assert e_cal.time_breakdown["tp"] != pytest.approx(e_nom.time_breakdown["tp"], rel=1e-3)


@pytest.mark.slow
def test_two_rank_probe_measures_every_collective_and_fits_the_intra_link(cal_dir):
    doc, path = run_probe(2, quick=True, dtypes=["float32"])
    assert doc["cluster"] == "local:1x2" and doc["world_size"] == 2 and path == calibration_path("local:1x2")
    colls = doc["collectives"]["intra"]
    assert set(colls) == {"all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all"}
    for op, rows in colls.items():
        assert [r for r in rows if "seconds" in r], op
        sizes = [r["bytes"] for r in rows]
        assert sizes == sorted(sizes) and sizes[-1] >= 2**20
    # the all-to-all also runs at 4x and 8x the largest ring size (EP's dispatch buffers are large)
    ring_max = colls["all_gather"][-1]["bytes"]
    assert [r["bytes"] for r in colls["all_to_all"]][-2:] == [4 * ring_max, 8 * ring_max]
    link = doc["links"]["intra"]
    assert link["bandwidth"] > 0 and link["latency"] >= 0
    assert local_cluster(2).groups[0].intra.bandwidth == pytest.approx(link["bandwidth"])
    # its own alpha-beta, carried into the planner's link and its all-to-all price
    assert link["a2a_bandwidth"] > 0 and link["a2a_latency"] >= 0
    intra = local_cluster(2).groups[0].intra
    assert (intra.a2a_bandwidth, intra.a2a_latency) == pytest.approx((link["a2a_bandwidth"], link["a2a_latency"]))
    from dtorch.plan.strategies.expert import all_to_all_time

    assert all_to_all_time(2 * 2**20, 2, 1, local_cluster(2).groups[0]) == pytest.approx(
        2**20 / link["a2a_bandwidth"] + link["a2a_latency"])
    # DTensor dispatch costs more than a plain tensor's, and the cluster the planner sees knows it
    assert doc["dtensor_op_overhead_s"] > 0
    assert local_cluster(2).groups[0].device.dtensor_op_overhead_s == pytest.approx(doc["dtensor_op_overhead_s"])
    # FSDP2's cost per unit and a functional collective's, as issued on this backend: each takes
    # time, and the planner's cluster carries them
    assert link["unit_gather_s"] + link["unit_reduce_s"] > 0 and link["func_latency_s"] > 0
    intra = local_cluster(2).groups[0].intra
    assert (intra.unit_gather_s, intra.unit_reduce_s_per_byte, intra.func_latency_s) == pytest.approx(
        (link["unit_gather_s"], link["unit_reduce_s_per_byte"], link["func_latency_s"]))
    # the wait at a blocking collective after each stretch of compute: every segment timed (the
    # GEMM loop lands within 3x of its target), every skew a time, carried into the link
    segs = [seg for seg, _, _ in link["sync_skew"]]
    assert len(segs) == 4 and all(t / 3 < seg < 3 * t for seg, t in zip(segs, (0.5e-3, 2e-3, 8e-3, 24e-3)))
    assert all(sk >= 0 and size == 2 for _, sk, size in link["sync_skew"])  # 2 ranks: one group of 2
    assert [list(r) for r in intra.sync_skew] == link["sync_skew"]


def test_damaged_calibration_is_rejected_by_name_and_ignored_by_the_cluster_loader(cal_dir):
    p = calibration_path("local:1x2")
    bad = _doc("local:1x2")
    bad["device"]["matmul_efficiency"] = 1.7
    p.write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="matmul_efficiency"):
        read_calibration(p)
    assert stored_calibration("local:1x2") is None
    assert local_cluster(2).groups[0].device.matmul_efficiency == local_cluster(2, calibrated=False).groups[0].device.matmul_efficiency
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid json"):
        read_calibration(p)
    with pytest.raises(ConfigError, match="version"):
        write_calibration({**_doc("x"), "version": 99}, cal_dir / "x.json")


def test_apply_marks_the_device_so_the_cost_models_name_table_does_not_override_the_measurement():
    h100 = load_cluster("h100:1x8")
    cal = apply_calibration(h100, {**_doc("h100", peak=5e14, eff=0.3), "device_kind": "cuda",
                                   "device": {"peak_flops": {"bfloat16": 5e14}, "matmul_efficiency": 0.3,
                                              "device_kind": "cuda"}})
    assert cal.groups[0].device.name.endswith("*")
    prof = get_profile("llama3-8b", 2048)
    plan = Plan(dp_shard=8, microbatch_size=1, param_dtype="bfloat16")
    assert estimate(plan, prof, cal).efficiency < estimate(plan, prof, h100).efficiency


def test_alpha_beta_fit_recovers_a_known_link():
    alpha, beta = 50e-6, 2e9
    pts = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        moved, steps = collective_steps(op, 4 if op != "p2p" else 2)
        for size in (4096, 65536, 2**20, 2**24):
            pts.append((steps, size * moved, alpha * steps + size * moved / beta))
    a, b = fit_alpha_beta(pts)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_gemm_fit_reproduces_a_curve_of_the_cost_models_shape():
    recs = [{"dtype": "float32", "rows": r, "width": w, "flops": 4e10 * 0.7 * shape_factor(w, r)}
            for r in (128, 512, 2048) for w in (32, 128, 512)]
    peak, eff = fit_gemm_efficiency(recs, dtype="float32")
    for r in recs:
        assert peak * eff * shape_factor(r["width"], r["rows"]) == pytest.approx(r["flops"], rel=1e-9)
    assert eff <= 1.0


def test_all_to_all_gets_its_own_fit_which_prices_ep_where_measured_and_only_there(cal_dir, tmp_path):
    from dtorch.cluster.load import save_cluster
    from dtorch.cluster.probe import _link_fit
    from dtorch.plan.strategies.expert import all_to_all_time

    # a ring at 2 GB/s + 100 us per step, an all-to-all at 0.5 GB/s + 300 us per peer (4 ranks)
    sizes = [4 ** i * 1024 for i in range(1, 9)]
    ring = [{"bytes": b, "seconds": 3 * 1e-4 + b * 0.75 / 2e9} for b in sizes[:6]]
    a2a = [{"bytes": b, "seconds": 3 * 3e-4 + b * 0.75 / 5e8} for b in sizes]
    fit = _link_fit({"all_gather": ring, "all_to_all": a2a}, 4, "shm")
    assert fit["bandwidth"] == pytest.approx(2e9, rel=1e-6) and fit["latency"] == pytest.approx(1e-4, rel=1e-6)
    assert fit["a2a_bandwidth"] == pytest.approx(5e8, rel=1e-6) and fit["a2a_latency"] == pytest.approx(3e-4, rel=1e-6)
    assert collective_steps("all_to_all", 4) == (0.75, 3.0)

    # a calibration without the fit (an older probe) keeps the ring's alpha-beta for the all-to-all
    write_calibration(_doc("local:1x2", bw=1e9, lat=1e-4), calibration_path("local:1x2"))
    g = local_cluster(2).groups[0]
    assert g.intra.a2a_bandwidth == 0.0
    assert all_to_all_time(4e6, 2, 1, g) == pytest.approx(2e6 / 1e9 + 1e-4)
    # with it, the all-to-all's own numbers, and a cluster file carries them through save and load
    doc = _doc("local:1x2", bw=1e9, lat=1e-4)
    doc["links"]["intra"].update(a2a_bandwidth=2.5e8, a2a_latency=4e-4)
    write_calibration(doc, calibration_path("local:1x2"))
    g = local_cluster(2).groups[0]
    assert all_to_all_time(4e6, 2, 1, g) == pytest.approx(2e6 / 2.5e8 + 4e-4)
    save_cluster(local_cluster(2), tmp_path / "c.yaml")
    assert load_cluster(str(tmp_path / "c.yaml")).groups[0].intra.a2a_bandwidth == pytest.approx(2.5e8)
    # a damaged value is rejected by name
    doc["links"]["intra"]["a2a_bandwidth"] = -1.0
    with pytest.raises(ConfigError, match="a2a_bandwidth"):
        write_calibration(doc, calibration_path("local:1x2"))


def _attention_rows(dtype: str = "float32", scale: float = 1.0) -> list[dict]:
    # a kernel twice as fast at head_dim 64 as at 16, and 1.5x as fast at seq 512 as at 128
    return [{"dtype": dtype, "head_dim": d, "seq": s, "batch": 1, "heads": 4,
             "flops": scale * 1e9 * {16: 1.0, 64: 2.0}[d] * {128: 1.0, 512: 1.5}[s]}
            for d in (16, 64) for s in (128, 512)]


def test_attention_speed_interpolates_the_measured_grid_in_log_space_and_holds_its_edges():
    dev = apply_calibration(local_cluster(1, calibrated=False),
                            {**_doc("local:1x1"), "attention": _attention_rows()}).groups[0].device
    assert dev.attention_speed("float32", 16, 128) == pytest.approx(1e9)
    assert dev.attention_speed("float32", 64, 512) == pytest.approx(3e9)
    assert dev.attention_speed("float32", 32, 128) == pytest.approx(2 ** 0.5 * 1e9)  # halfway in log head_dim
    assert dev.attention_speed("float32", 32, 256) == pytest.approx(2 ** 0.5 * 1.5 ** 0.5 * 1e9)
    assert dev.attention_speed("float32", 8, 64) == pytest.approx(1e9)  # below the grid: its edge
    assert dev.attention_speed("float32", 256, 8192) == pytest.approx(3e9)  # above it
    assert dev.attention_speed("bfloat16", 16, 128) is None  # not measured in this dtype
    assert local_cluster(1, calibrated=False).groups[0].device.attention_speed("float32", 16, 128) is None


def test_a_measured_attention_kernel_is_priced_at_its_own_speed_and_nothing_else_moves():
    prof = get_profile("llama-tiny", 128)
    hd = prof.hidden / prof.num_heads
    base = apply_calibration(local_cluster(1, calibrated=False), _doc("local:1x1"))
    slow = apply_calibration(local_cluster(1, calibrated=False),
                             {**_doc("local:1x1"), "attention": _attention_rows(scale=0.25)})
    speed = slow.groups[0].device.attention_speed("float32", hd, prof.seq_len)
    for plan in (Plan(microbatch_size=4, param_dtype="float32"),
                 Plan(microbatch_size=4, param_dtype="float32", ac="full")):
        e0, e1 = estimate(plan, prof, base, "float32"), estimate(plan, prof, slow, "float32")
        st = step_shape(plan, prof, base, "float32")
        attn_flops = plan.num_microbatches * st.tokens_mb * prof.num_layers * 3 * st.attn_fwd
        extra = attn_flops * (1 / speed - 1 / st.speed)
        if plan.ac == "full":  # the recomputed forward holds a third of the attention's FLOPs again
            extra *= 1 + (e0.time_breakdown["recompute"] / e0.time_breakdown["compute"])
        assert e1.time_breakdown["compute"] - e0.time_breakdown["compute"] == pytest.approx(
            attn_flops * (1 / speed - 1 / st.speed), rel=1e-6)
        assert e1.step_time_s - e0.step_time_s == pytest.approx(extra, rel=1e-6)
        assert {k: v for k, v in e1.time_breakdown.items() if k not in ("compute", "recompute")} == pytest.approx(
            {k: v for k, v in e0.time_breakdown.items() if k not in ("compute", "recompute")})


def test_a_malformed_attention_row_is_rejected_by_name(cal_dir):
    doc = {**_doc("local:1x1"), "attention": [{"dtype": "float32", "head_dim": 16, "seq": 128, "flops": -1.0}]}
    with pytest.raises(ConfigError, match=r"attention\[0\]"):
        validate_calibration(doc)


SKEW = [[0.5e-3, 0.2e-3], [2e-3, 0.5e-3], [8e-3, 1e-3], [24e-3, 2e-3]]


def test_skew_interpolates_in_log_space_scales_below_the_shortest_segment_and_holds_above():
    link = apply_calibration(local_cluster(2, calibrated=False), {**_doc("local:1x2"), "links": {"intra": {
        "kind": "shm", "bandwidth": 1e9, "latency": 1e-4, "sync_skew": SKEW}}}).groups[0].intra
    assert link.skew(2e-3) == pytest.approx(0.5e-3)
    assert link.skew(4e-3) == pytest.approx((0.5e-3 * 1e-3) ** 0.5)  # halfway in log segment
    assert link.skew(0.25e-3) == pytest.approx(0.1e-3)  # proportional below 0.5 ms
    assert link.skew(0.1) == pytest.approx(2e-3)  # held above 24 ms
    assert link.skew(0.0) == 0.0
    assert local_cluster(2, calibrated=False).groups[0].intra.skew(1e-3) == 0.0  # unmeasured: no wait


def test_skew_is_read_for_the_group_size_that_waits():
    rows = [[2e-3, 1e-3, 2], [2e-3, 3e-3, 4], [2e-3, 7e-3, 8]]
    link = apply_calibration(local_cluster(8, calibrated=False), {**_doc("local:1x8"), "links": {"intra": {
        "kind": "shm", "bandwidth": 1e9, "latency": 1e-4, "sync_skew": rows}}}).groups[0].intra
    assert [link.skew(2e-3, n) for n in (2, 4, 8)] == pytest.approx([1e-3, 3e-3, 7e-3])
    assert link.skew(2e-3, 6) == pytest.approx(3e-3)  # unmeasured size: the largest measured below it
    assert link.skew(2e-3, 1) == pytest.approx(1e-3)  # below every size: the smallest
    assert link.skew(2e-3) == pytest.approx(7e-3)  # no size given: the node's
    # a two-column curve (an older probe's) is the node's, whatever the group
    old = apply_calibration(local_cluster(8, calibrated=False), {**_doc("local:1x8"), "links": {"intra": {
        "kind": "shm", "bandwidth": 1e9, "latency": 1e-4, "sync_skew": SKEW}}}).groups[0].intra
    assert old.skew(2e-3, 2) == old.skew(2e-3, 8) == pytest.approx(0.5e-3)


def test_blocking_collectives_wait_for_the_slowest_peer_and_only_they_do():
    prof = get_profile("llama-tiny", 128)
    base = {**_doc("local:1x2"), "links": {"intra": {"kind": "shm", "bandwidth": 1e9, "latency": 1e-4}}}
    skewed = {**base, "links": {"intra": {**base["links"]["intra"], "sync_skew": SKEW}}}
    c0 = apply_calibration(local_cluster(2, calibrated=False), base)
    c1 = apply_calibration(local_cluster(2, calibrated=False), skewed)
    link = c1.groups[0].intra
    tp, cp = Plan(tp=2, sp=True, microbatch_size=8), Plan(cp=2, microbatch_size=8)
    for plan, term in ((tp, "tp"), (cp, "cp")):
        e0, e1 = estimate(plan, prof, c0, "float32"), estimate(plan, prof, c1, "float32")
        b = e0.time_breakdown
        # CP: a K/V all-gather and its reduce-scatter per block; TP: 8 activation collectives per
        # block, 2 more where sequence parallelism gathers its inputs again in the backward, and the
        # latency-bound redistributions
        n = prof.num_layers * 2 if term == "cp" else \
            prof.num_layers * (8 + 2) + step_counts(plan, prof, "cpu").tp_small_per_microbatch
        seg = (b["compute"] + b["recompute"] + b["host"]) / n
        assert e1.time_breakdown[term] - b[term] == pytest.approx(n * link.skew(seg), rel=1e-6)
        assert e1.step_time_s - e0.step_time_s == pytest.approx(n * link.skew(seg), rel=1e-6)
    # data parallelism and pipelining issue their collectives asynchronously: nothing added
    for plan in (Plan(dp_replicate=2, microbatch_size=4), Plan(dp_shard=2, microbatch_size=4),
                 Plan(pp=2, num_microbatches=4, microbatch_size=2)):
        assert estimate(plan, prof, c1, "float32").step_time_s == pytest.approx(
            estimate(plan, prof, c0, "float32").step_time_s)


def test_a_malformed_skew_curve_is_rejected_by_name():
    doc = {**_doc("local:1x2"), "links": {"intra": {"kind": "shm", "bandwidth": 1e9, "latency": 1e-4,
                                                    "sync_skew": [[1e-3]]}}}
    with pytest.raises(ConfigError, match="sync_skew"):
        validate_calibration(doc)


def test_tp_pays_the_skew_of_its_own_group_size():
    prof = get_profile("llama-tiny", 128)
    link = {"kind": "shm", "bandwidth": 1e9, "latency": 1e-4}
    doc = _doc("local:1x4")
    pairs, node = [[2e-3, 1e-3, 2]], [[2e-3, 4e-3, 4]]

    def tp_s(plan: Plan, rows) -> float:
        c = apply_calibration(local_cluster(4, calibrated=False),
                              {**doc, "links": {"intra": {**link, **({"sync_skew": rows} if rows else {})}}})
        return estimate(plan, prof, c, "float32").time_breakdown["tp"]

    tp2 = Plan(tp=2, sp=True, dp_replicate=2, microbatch_size=4)
    tp4 = Plan(tp=4, sp=True, microbatch_size=8)
    # a pair of the four ranks waits as pairs do, whatever the whole node's curve says
    assert tp_s(tp2, pairs + node) == pytest.approx(tp_s(tp2, pairs))
    assert tp_s(tp2, pairs) > tp_s(tp2, None) * 1.01
    assert tp_s(tp4, pairs + node) == pytest.approx(tp_s(tp4, node))
    assert tp_s(tp4, node) > tp_s(tp4, pairs) * 1.01
