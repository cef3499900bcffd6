"""Every plan the search emits is applied as written: no Plan field is silently ignored.

For the reference models (tiny GPT and Llama) on CPU clusters of 1, 2 and 4 ranks, every plan of
`dtorch.plan.search.search` (the top plans and the best of every family), plus hand-made plans for
field values the search does not emit today (uneven layer partitions, CPU offload, bfloat16
reduction, selective AC, GPipe), is applied by `parallelize` on one process per representative
rank (every pipeline rank's first rank) joined to PyTorch's fake process group at the plan's world
size, then one step's forward and backward run there (numbers are garbage under the fake group;
what is inspected is not). Each Plan field has a check that inspects the applied model:

mesh axes and sizes, data-parallel wrappers (DDP / FSDP units / replicate), TP placements, CP hooks,
the pipeline schedule, its stages and their block counts, checkpoint wrappers, FSDP offload and
reshard settings, the dtype of every matrix multiplication in the step (param_dtype) and of every
gradient collective issued during backward (reduce_dtype), the batch of every micro-batch forward.

`CHECKS` must name every field of `dataclasses.fields(Plan)` (or `INFORMATIONAL`, with the reason
the executor has nothing to apply): a new field fails `test_every_plan_field_is_checked` until
the executor honours it and a check says so (or check.py refuses it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
import _training  # noqa: E402

from dtorch.errors import ConfigError  # noqa: E402
from dtorch.model.structure import block_items, find_blocks  # noqa: E402
from dtorch.models import build_model  # noqa: E402
from dtorch.parallel.pipeline import layer_partition, stage_ids  # noqa: E402
from dtorch.parallel.rng import has_random_ops, shard_stream_rank  # noqa: E402
from dtorch.plan.plan import Plan  # noqa: E402
from dtorch.train.losses import next_token  # noqa: E402

SEQ = _training.SEQ


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread is 20-40x faster than many on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
GLOBAL_BATCH = 8
MODELS = ("llama-tiny", "gpt-tiny")


def _emitted() -> dict[str, tuple[str, Plan]]:
    from dtorch.cluster.load import parse_shorthand
    from dtorch.plan.profiles import get_profile
    from dtorch.plan.search import search

    out: dict[str, tuple[str, Plan]] = {}
    for world in (1, 2, 4):
        cluster = parse_shorthand(f"cpu:1x{world}")
        for model in MODELS:
            res = search(get_profile(model, SEQ), cluster, global_batch=GLOBAL_BATCH, seq_len=SEQ, top_k=5)
            for plan, _ in [*res.ranked, *res.best_by_family.values()]:
                fields = {k: v for k, v in plan.to_dict().items() if k != "predicted"}
                key = f"w{world} {model} {plan.describe()} {plan.param_dtype}/{plan.reduce_dtype}"
                out.setdefault(key, (model, Plan.from_dict(fields) if hasattr(Plan, "from_dict") else plan))
    return out


HAND_MADE = {
    "pp uneven [3,1] gpipe": ("gpt-tiny", Plan(pp=2, schedule="gpipe", num_microbatches=2, layer_partition=[3, 1])),
    "pp uneven [1,3] 1f1b fsdp": ("llama-tiny", Plan(pp=2, dp_shard=2, num_microbatches=2, layer_partition=[1, 3],
                                                     param_dtype="bfloat16")),
    "fsdp offload params reduce bf16": ("llama-tiny", Plan(dp_shard=2, offload="params", reduce_dtype="bfloat16")),
    "ddp fp32 params reduce bf16": ("gpt-tiny", Plan(dp_replicate=2, reduce_dtype="bfloat16")),
    "hsdp selective ac accumulation": ("llama-tiny", Plan(dp_replicate=2, dp_shard=2, ac="selective",
                                                          num_microbatches=2, param_dtype="bfloat16")),
    "tp no sp full ac fp32": ("gpt-tiny", Plan(tp=2, ac="full", microbatch_size=2)),
    "single fp32 accumulation": ("gpt-tiny", Plan(microbatch_size=2, num_microbatches=3)),
    # compile=true is only emitted by the search with a calibrated gain: one applied, one refused
    "single compile": ("llama-tiny", Plan(compile=True)),
    "tp full ac compile refused": ("gpt-tiny", Plan(tp=2, ac="full", compile=True)),
    # uneven data-parallel shares (mixed devices): data-parallel rank 0 runs 3 micro-batches, rank 1 one
    "fsdp uneven shares [3,1]": ("llama-tiny", Plan(dp_shard=2, num_microbatches=2, dp_shares=[3, 1],
                                                                    reshard_after_forward=False)),
    "ddp x pp uneven shares [3,1] gpipe": ("gpt-tiny", Plan(dp_replicate=2, pp=2, schedule="gpipe", num_microbatches=2,
                                                            dp_shares=[3, 1])),
    # ZeRO-1/2, as the search offers them beside FSDP plans (`Zero.stages`) or --fix zero=N pins them
    # (the planner's best plan of every family, ZeRO's among them, runs in test_planner_plans.py)
    "zero1 accumulation": ("llama-tiny", Plan(dp_shard=2, zero=1, num_microbatches=2)),
    "zero2 x tp accumulation bf16": ("llama-tiny", Plan(dp_shard=2, tp=2, zero=2, num_microbatches=2,
                                                        param_dtype="bfloat16")),
    "zero2 x pp": ("gpt-tiny", Plan(dp_shard=2, pp=2, zero=2, num_microbatches=2)),
    # ring attention where the CPU prices the all-gather lower
    "cp ring": ("llama-tiny", Plan(cp=2, cp_attention="ring", reshard_after_forward=False)),
    "cp ring x pp": ("gpt-tiny", Plan(cp=2, pp=2, cp_attention="ring", num_microbatches=2,
                                      reshard_after_forward=False)),
}
PLANS = {**_emitted(), **HAND_MADE}


# ---- what a step does: matmul dtypes, gradient collectives, micro-batch forwards ------------------
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default}


class _MatmulDtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _MATMULS:
            self.dtypes.update(a.dtype for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _gradient_collectives(record: list):
    """Record the dtype of every c10d collective issued while autograd runs a backward."""
    names = [n for n in ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def wrap(name):
        def run(*args, **kwargs):
            if torch._C._current_graph_task_id() != -1:
                t = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
                record.append((name, t.dtype))
            return originals[name](*args, **kwargs)
        return run

    for n in names:
        setattr(dist, n, wrap(n))
    try:
        yield
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)


def _run_step(pm, plan: Plan, model_name: str) -> dict:
    """One forward and backward on this rank; what it did."""
    rec: dict = {"forward_batches": [], "collectives": []}
    root = pm.model_parts[0].module if isinstance(pm.model_parts[0], DistributedDataParallel) else pm.model_parts[0]
    root.register_forward_pre_hook(lambda m, args: rec["forward_batches"].append(args[0].shape[0]))
    mode = _MatmulDtypes()
    x, y = _training.batch(0, pm.local_batch)  # this rank's share (plan.dp_shares) of the global batch
    # torch.compile cannot trace under the dispatch mode that records the matmuls' dtypes: a compiled
    # plan's step runs its compiled blocks eagerly here (the same ops); `check_compile` inspects the
    # blocks themselves, and tests/parallel/test_compile.py runs compiled steps against eager ones
    nocompile = torch.compiler.set_stance("force_eager") if getattr(plan, "compile", False) else contextlib.nullcontext()
    with _gradient_collectives(rec["collectives"]), nocompile:
        if pm.schedule is None:
            with mode:
                pm.forward_backward(x, y)
        else:
            # The schedule's point-to-point traffic cannot run on the fake group: run this rank's
            # stages one micro-batch each, as the schedule would.
            dim = build_model(model_name).config.dim
            mb = plan.microbatch_size
            for part, stage in zip(pm.model_parts, pm.stage_ids if hasattr(pm, "stage_ids") else
                                   stage_ids(plan, _pp_rank(pm))):
                inp = x[:mb] if stage == 0 else torch.randn(mb, SEQ, dim)
                with pm._compute_context(), mode:
                    out = part(inp)
                    loss = next_token(out, y[:mb]) if stage == plan.num_stages - 1 else out.float().mean()
                    loss.backward()
    rec["matmul_dtypes"] = mode.dtypes
    return rec


def _pp_rank(pm) -> int:
    return pm.mesh["pp"].get_local_rank()


def _apply(model_name: str, plan: Plan, rank: int):
    from dtorch.parallel import parallelize

    pm = parallelize(partial(_training.factory, model_name), plan, loss_fn=next_token, seq_len=SEQ)
    return pm, _run_step(pm, plan, model_name)


def _ranks(plan: Plan) -> list[int]:
    from dtorch.parallel.dryrun import representative_ranks

    return representative_ranks(plan)


# ---- the checks, one per Plan field ------------------------------------------------------------------
def _mesh(pm) -> dict[str, int]:
    if pm.mesh is None:
        return {}
    return dict(zip(pm.mesh.mesh_dim_names, pm.mesh.shape))


def _check_axis(axis: str):
    def check(plan: Plan, pm, rec: dict) -> None:
        mesh = _mesh(pm)
        if getattr(plan, axis) > 1:
            assert mesh.get(axis) == getattr(plan, axis), (axis, mesh)
        else:
            assert axis not in mesh or plan.world_size == 1, (axis, mesh)
    return check


def _parts(pm) -> list[nn.Module]:
    return [p.module if isinstance(p, DistributedDataParallel) else p for p in pm.model_parts]


def _blocks(part: nn.Module) -> list[nn.Module]:
    return [b for _, b in block_items(find_blocks(part)[1])]


def _inner(block: nn.Module) -> nn.Module:
    """The model's own block under torch.compile's and activation checkpointing's wrappers."""
    block = getattr(block, "_orig_mod", block)
    return getattr(block, "_checkpoint_wrapped_module", block)


def _dtensor_axes(p: torch.Tensor) -> dict[str, object]:
    if not isinstance(p, DTensor):
        return {}
    return dict(zip(p.device_mesh.mesh_dim_names, p.placements))


def check_dp_replicate(plan: Plan, pm, rec: dict) -> None:
    _check_axis("dp_replicate")(plan, pm, rec)
    if plan.dp_replicate > 1:
        part = pm.model_parts[0]
        assert isinstance(part, DistributedDataParallel | FSDPModule), type(part)
        if isinstance(part, DistributedDataParallel):
            assert part.process_group.size() == plan.dp_replicate
        else:  # HSDP or replicate: parameters replicated over the dp_replicate axis
            assert all(isinstance(_dtensor_axes(p).get("dp_replicate"), Replicate) for p in part.parameters())
    else:
        assert not isinstance(pm.model_parts[0], DistributedDataParallel)


def check_dp_shard(plan: Plan, pm, rec: dict) -> None:
    _check_axis("dp_shard")(plan, pm, rec)
    for part in _parts(pm):
        for block in _blocks(part):
            sharded = isinstance(block, FSDPModule) and any(
                isinstance(pl, Shard) and ax in ("dp_shard", "dp_shard_cp", "cp")
                for p in block.parameters() for ax, pl in _dtensor_axes(p).items())
            assert sharded == (plan.dp_shard > 1 or plan.cp > 1), (type(block), plan.describe())


def check_cp(plan: Plan, pm, rec: dict) -> None:
    _check_axis("cp")(plan, pm, rec)
    part = _parts(pm)[0]
    hooks = [part.token_positions] + [m.core_attention for m in part.modules() if "core_attention" in dir(type(m))]
    # TP without SP wraps the attention core to draw on the TP shard's stream (rng.py)
    cores = [getattr(h, "keywords", {}).get("inner", h) if isinstance(h, partial) else h for h in hooks[1:]]
    if plan.cp > 1:
        assert pm.context is not None and pm.context.size == plan.cp
        assert hooks[0] is not None and all(c is not None for c in cores)
    else:
        assert pm.context is None and hooks[0] is None and all(c is None for c in cores)


def check_cp_attention(plan: Plan, pm, rec: dict) -> None:
    # the attention over the whole sequence is the plan's: all-gathered K/V or the ring's send/recv
    if plan.cp > 1:
        assert pm.context.method == plan.cp_attention
        assert (pm.context._ring is not None) == (plan.cp_attention == "ring")


def check_tp(plan: Plan, pm, rec: dict) -> None:
    _check_axis("tp")(plan, pm, rec)
    for part in _parts(pm):
        for block in _blocks(part):
            wq = _inner(block).attention.wq.weight
            placement = _dtensor_axes(wq).get("tp")
            assert (placement == Shard(0)) == (plan.tp > 1), (placement, plan.describe())


def check_pp(plan: Plan, pm, rec: dict) -> None:
    _check_axis("pp")(plan, pm, rec)
    assert (pm.schedule is not None) == (plan.pp > 1)


def check_sp(plan: Plan, pm, rec: dict) -> None:
    for part in _parts(pm):
        for block in _blocks(part):
            inner = _inner(block)
            norm_tp = _dtensor_axes(inner.attention_norm.weight).get("tp")
            assert (norm_tp is not None) == plan.sp, (norm_tp, plan.describe())
            # (a block that draws no random numbers needs no stream: tp.py)
            assert (shard_stream_rank(inner) is not None) == (plan.sp and has_random_ops(inner))
            # without SP only the attention core (head shards) runs on the shard stream
            assert (shard_stream_rank(inner.attention) is not None) == (plan.tp > 1 and not plan.sp)


def _own_microbatches(plan: Plan, pm) -> int:
    """Micro-batches this rank must run: its dp_shares entry, or num_microbatches."""
    return plan.dp_shares[pm.dp_rank] if plan.dp_shares else plan.num_microbatches


def check_microbatch_size(plan: Plan, pm, rec: dict) -> None:
    if pm.schedule is None:
        assert rec["forward_batches"] == [plan.microbatch_size] * _own_microbatches(plan, pm), rec["forward_batches"]
    else:  # the schedule cuts the local batch (microbatch_size x micro-batches) into its micro-batches
        assert pm.schedule._n_microbatches * plan.microbatch_size == pm.local_batch


def check_num_microbatches(plan: Plan, pm, rec: dict) -> None:
    if pm.schedule is None:
        assert len(rec["forward_batches"]) == _own_microbatches(plan, pm)
    else:
        assert pm.schedule._n_microbatches == _own_microbatches(plan, pm)


def check_dp_shares(plan: Plan, pm, rec: dict) -> None:
    # this rank runs its own share (forward count / schedule length: check_num_microbatches) of
    # the global batch, whose size the shares do not change
    assert pm.num_local_microbatches == _own_microbatches(plan, pm)
    assert pm.local_batch == plan.microbatch_size * _own_microbatches(plan, pm)
    if plan.dp_shares is not None:
        assert sum(plan.dp_shares) * plan.microbatch_size == plan.dp * plan.local_batch()
        assert pm.uneven == (len(set(plan.dp_shares)) > 1)


_SCHEDULE_CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                   "zero_bubble": "ScheduleInterleavedZeroBubble"}


def check_schedule(plan: Plan, pm, rec: dict) -> None:
    if plan.pp > 1:
        assert type(pm.schedule).__name__ == _SCHEDULE_CLASS[plan.schedule]
    # pp == 1: documented as ignored (no pipeline); check_pp pins that no schedule exists


def check_virtual_stages(plan: Plan, pm, rec: dict) -> None:
    n = len(pm.model_parts)
    assert n == (plan.virtual_stages if plan.pp > 1 else 1)


def check_layer_partition(plan: Plan, pm, rec: dict) -> None:
    num_layers = build_model(rec["model"]).config.n_layers
    sizes = layer_partition(plan, num_layers)
    if plan.layer_partition is not None:
        assert sizes == list(plan.layer_partition)
    stages = stage_ids(plan, _pp_rank(pm)) if plan.pp > 1 else [0]
    for part, stage in zip(_parts(pm), stages):
        names = [n for n, _ in block_items(find_blocks(part)[1])]
        start = sum(sizes[:stage])
        assert names == [str(i) for i in range(start, start + sizes[stage])], (stage, names, sizes)


def check_ac(plan: Plan, pm, rec: dict) -> None:
    for part in _parts(pm):
        blocks = _blocks(part)
        wrapped = [b for b in blocks if hasattr(b, "_checkpoint_wrapped_module")]
        assert len(wrapped) == (len(blocks) if plan.ac != "none" else 0)
        for b in wrapped:
            kw = b.checkpoint_fn.keywords
            assert kw["preserve_rng_state"] is True
            assert ("context_fn" in kw) == (plan.ac == "selective")


def _fsdp_units(pm) -> list[tuple[str, FSDPModule]]:
    return [(n, m) for part in _parts(pm) for n, m in part.named_modules() if isinstance(m, FSDPModule)]


def check_offload(plan: Plan, pm, rec: dict) -> None:
    units = _fsdp_units(pm)
    for _, unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is not None:
            assert isinstance(group.offload_policy, CPUOffloadPolicy) == (plan.offload == "params")
    if plan.offload == "params":
        assert units and all(p.to_local().device.type == "cpu" for part in _parts(pm) for p in part.parameters())


def check_reshard_after_forward(plan: Plan, pm, rec: dict) -> None:
    if not (plan.dp_shard > 1 or plan.cp > 1):
        return  # no sharded parameters: nothing is gathered, nothing to free
    for part, stage in zip(_parts(pm), stage_ids(plan, _pp_rank(pm)) if plan.pp > 1 else [0]):
        blocks = _blocks(part)
        for i, block in enumerate(blocks):
            keep_last = stage == plan.num_stages - 1 and i == len(blocks) - 1 and plan.pp == 1
            group = block._get_fsdp_state()._fsdp_param_group
            # (ZeRO-1/2 keep every unit gathered within the step: check_zero)
            reshard = plan.reshard_after_forward and not keep_last and not getattr(plan, "zero", 0)
            assert (group.post_forward_mesh_info is not None) == reshard


def check_param_dtype(plan: Plan, pm, rec: dict) -> None:
    assert rec["matmul_dtypes"] == {getattr(torch, plan.param_dtype)}, rec["matmul_dtypes"]


def check_reduce_dtype(plan: Plan, pm, rec: dict) -> None:
    dtypes = {d for _, d in rec["collectives"]}
    if plan.dp > 1 or plan.cp > 1:  # gradients are averaged over data (and context) parallel ranks
        assert dtypes == {getattr(torch, plan.reduce_dtype)}, rec["collectives"]
    else:
        assert not dtypes, rec["collectives"]


def check_global_batch(plan: Plan, pm, rec: dict) -> None:
    if plan.global_batch is not None:
        assert plan.global_batch == pm.dp_size * plan.local_batch()
    assert pm.dp_size == plan.dp


def check_seq_len(plan: Plan, pm, rec: dict) -> None:
    # the executor is told the sequence length at parallelize (checked there: CP chunks, SP shards)
    if plan.seq_len is not None:
        assert plan.seq_len == SEQ


def check_compile(plan: Plan, pm, rec: dict) -> None:
    from torch._dynamo.eval_frame import OptimizedModule

    for part in _parts(pm):
        for block in _blocks(part):
            assert isinstance(block, OptimizedModule) == bool(getattr(plan, "compile", False)), type(block)


def check_ep(plan: Plan, pm, rec: dict) -> None:
    # routed experts sharded over ep ranks with the all-to-all dispatcher installed (ep > 1), or left
    # whole with none (ep = 1; the dense reference models have no experts at all). The MoE side, ep > 1
    # run for real: tests/parallel/test_moe_planner_plans.py
    experts = [m for part in _parts(pm) for m in part.modules() if hasattr(type(m), "dispatcher")]
    for m in experts:
        # (tp > 1 installs the dispatcher too, with ep=1: the experts' hidden units split over tp)
        assert (m.dispatcher is not None) == (plan.ep > 1 or plan.tp > 1)
        assert m.dispatcher is None or m.dispatcher.keywords["ep"] == plan.ep
        if plan.ep > 1:
            w = m.w1.to_local() if hasattr(m.w1, "to_local") else m.w1
            assert w.shape[0] * plan.ep == m.w1.shape[0]


def check_zero(plan: Plan, pm, rec: dict) -> None:
    # ZeRO-1/2: every FSDP unit stays gathered from forward to backward, and one step's backward
    # reduce-scatters what the planner prices per unit (ZeRO-1 once, ZeRO-2 every micro-batch);
    # the collectives themselves, counted on real ranks: tests/parallel/test_zero.py
    from dtorch.plan.strategies.zero import ZERO, zero_stage

    if not zero_stage(plan):
        return
    units = [m for part in _parts(pm) for m in part.modules() if isinstance(m, FSDPModule)]
    groups = [g for u in units if (g := u._get_fsdp_state()._fsdp_param_group) is not None]
    assert groups and all(g.post_forward_mesh_info is None for g in groups)
    if plan.pp == 1:  # (a pipeline's schedule does not run on the fake group)
        rs = sum(1 for name, _ in rec["collectives"] if name.startswith("reduce_scatter"))
        assert rs == ZERO.collectives(plan)[1] * len(groups), rec["collectives"]


CHECKS = {
    "ep": check_ep,
    "dp_replicate": check_dp_replicate, "dp_shard": check_dp_shard, "cp": check_cp, "tp": check_tp,
    "pp": check_pp, "sp": check_sp, "microbatch_size": check_microbatch_size,
    "num_microbatches": check_num_microbatches, "dp_shares": check_dp_shares, "schedule": check_schedule,
    "virtual_stages": check_virtual_stages, "layer_partition": check_layer_partition, "ac": check_ac,
    "offload": check_offload, "reshard_after_forward": check_reshard_after_forward,
    "param_dtype": check_param_dtype, "reduce_dtype": check_reduce_dtype,
    "global_batch": check_global_batch, "seq_len": check_seq_len,
}
if "compile" in {f.name for f in dataclasses.fields(Plan)}:  # the field the strategy registry adds
    CHECKS["compile"] = check_compile
CHECKS["zero"] = check_zero
CHECKS["cp_attention"] = check_cp_attention
INFORMATIONAL = {
    "model": "names the model the plan was made for; the model itself is passed to parallelize",
    "cluster": "names the cluster the plan was made for; the executor runs where it is launched",
    "predicted": "the planner's estimate, read by the trainer's runtime feedback, not applied",
    "version": "Plan.validate refuses another version before anything is applied",
}


def test_every_plan_field_is_checked() -> None:
    names = {f.name for f in dataclasses.fields(Plan)}
    unchecked = names - set(CHECKS) - set(INFORMATIONAL)
    assert not unchecked, f"Plan fields no check of this test covers: {sorted(unchecked)}"
    assert not (set(CHECKS) | set(INFORMATIONAL)) - names


def test_search_emits_plans_at_every_world_size() -> None:
    worlds = {plan.world_size for _, plan in PLANS.values()}
    assert worlds == {1, 2, 4} and len(PLANS) >= 30


def _expected_refusal(plan: Plan) -> str | None:
    from dtorch.plan.limits import unsupported

    return unsupported(plan)


def _forget_previous_groups() -> None:
    """DTensor caches sharding decisions and redistribution plans keyed by specs whose meshes
    compare equal across worlds of the same layout, but name the previous world's process groups
    ("Could not resolve the process group registered under the name 3"): drop them before this
    process joins another fake world."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from dtorch.parallel import mesh

    mesh._MESHES.clear()
    _gen_transform_infos.cache_clear()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path keeps its own


@pytest.mark.parametrize("key", list(PLANS))
def test_plan_is_applied_as_written(key: str) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model_name, plan = PLANS[key]
    for rank in _ranks(plan):
        _forget_previous_groups()
        if plan.world_size > 1:
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
        try:
            if _expected_refusal(plan) is not None:
                with pytest.raises(ConfigError):
                    _apply(model_name, plan, rank)
                return
            pm, rec = _apply(model_name, plan, rank)
            rec["model"] = model_name
            for name, check in CHECKS.items():
                try:
                    check(plan, pm, rec)
                except AssertionError as e:
                    raise AssertionError(f"rank {rank}: field {name}={getattr(plan, name)!r} not honoured: {e}") from e
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def test_float16_is_refused_before_any_work() -> None:
    from dtorch.parallel import parallelize

    for field in ("param_dtype", "reduce_dtype"):
        with pytest.raises(ConfigError, match="loss scaling"):
            parallelize(partial(_training.factory, "gpt-tiny"), Plan(**{field: "float16"}), loss_fn=next_token)
