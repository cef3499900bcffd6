"""How the trainer's parts are built: the model factory and its checks, the process group and
device, the optimizers (in device memory or an offload tier), the learning-rate schedules' state,
the plan's announcement, and the whole model's weights after training."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtorch.env import RuntimeEnv
from dtorch.errors import ConfigError
from dtorch.train import hooks

Trainer = Any
"""A `dtorch.train.trainer.Trainer` (not imported: the trainer imports this module)."""

log = logging.getLogger("dtorch.train")


def model_factory(model: Any, init_from: Path | None) -> tuple[Any, dict | None]:
    """The model factory and the Hugging Face config of `init_from` (None without), after the checks
    of `init_from` that need no process group: the directory's architecture is known and every
    tensor's shape matches the model."""
    if init_from is None:
        if model is None:
            raise ConfigError("model", None, "pass a model (a factory or a module), or init_from=<HF directory>")
        return model, None
    from dtorch.checkpoint.hf_weights import HFWeights, model_shapes, read_config

    weights = HFWeights(init_from)  # ConfigError: not a model directory, unknown architecture
    if model is None:
        if weights.seed:
            raise ConfigError("model", None, f"{init_from} is a seed checkpoint: pass the model it was "
                              "written from")
        from dtorch.models import build_from_config

        config = weights.config
        model = lambda: build_from_config(config)  # noqa: E731 - a factory, called on meta
    hf_config = None if weights.seed else read_config(init_from)
    from dtorch.parallel.hf import adapt
    from dtorch.parallel.parallelize import meta_model

    skeleton = adapt(model) if isinstance(model, nn.Module) else meta_model(model)
    weights.check(model_shapes(skeleton))  # ConfigError naming the tensor
    return model, hf_config


def check_vocab(factory: Any, data: Any, eval_data: Any = None) -> None:
    """A dataset's token ids must fit the model's embedding (checked before any process group)."""
    vocab = max([v for v in (getattr(d, "vocab_size", None) for d in (data, eval_data)) if v is not None], default=None)
    if vocab is None:
        return
    from dtorch.parallel.parallelize import meta_model

    model = factory  # a module is looked at as it is (no copy of real weights)
    model = model if isinstance(model, nn.Module) else meta_model(model)
    emb = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if emb and int(vocab) > emb[0].num_embeddings:
        raise ConfigError("tokenizer", f"vocabulary of {vocab} tokens",
                          f"the model's embedding has {emb[0].num_embeddings} rows; use a tokenizer with at "
                          "most that many tokens or a model with a larger vocab_size")


def check_fit(tr: Trainer, steps: int) -> None:
    """What only the number of steps or the data makes wrong, before any work (ConfigError): a
    schedule whose phases do not fit in `steps`, an evaluation set smaller than one global batch."""
    check = getattr(tr.lr_spec, "check", None)
    if check is not None:
        check(steps)
    if tr.eval_spec is not None:
        from dtorch.train.evaluate import eval_batches

        eval_batches(tr)


def join(run_env: RuntimeEnv, by_scheduler: bool) -> tuple[int, int, torch.device]:
    """Join the default process group when launched with several ranks (`by_scheduler`: one process
    per rank started by a scheduler, srun -n N); pick the device."""
    world = run_env.world_size or 1
    cuda = torch.cuda.is_available()
    if cuda:
        local_rank = run_env.local_rank or 0
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local = run_env.local_world_size or 1
        if local > 1 and run_env.omp_num_threads is None:
            # ranks of one CPU node share its cores: a rank's share of threads, not all of them
            # each (oversubscribed threads measured 2-20x slower); the planner prices this share
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    if world > 1 and not dist.is_initialized():
        if run_env.run_dir or by_scheduler:
            # under `dtorch run` or a scheduler: a store that listens on MASTER_ADDR only
            # (torch's listens on every interface)
            from dtorch.process_group import init_process_group

            hooks.phase_begin("pg_init")  # timed into the recovery record under `dtorch run`
            init_process_group("nccl" if cuda else "gloo")
        else:
            dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, device


def announce_plan(tr: Trainer) -> None:
    """The `plan` event and, on rank 0, the plan's console line."""
    from dtorch.cluster.peak import mfu
    from dtorch.plan.explain import memory_parts, memory_summary

    pred = tr.plan.predicted or {}
    breakdown = pred.get("memory_breakdown") or {}
    parts = memory_parts(breakdown) if breakdown else {}
    peak, fpt = device_peak(tr), flops_per_token(tr)
    # the prediction's MFU over this run's denominator (a plan kept from a checkpoint or a file may
    # carry one computed elsewhere); for a plan searched here it is the plan's own figure
    predicted_mfu = mfu(pred["tokens_per_s"], fpt, peak, tr.world) if pred.get("tokens_per_s") else pred.get("mfu")
    tr.metrics.event("plan", plan=tr.plan.describe(), family=tr.plan.family(), source=tr.plan_source.source,
                     predicted_step_time_s=pred.get("step_time_s"), predicted_mfu=predicted_mfu,
                     predicted_tokens_per_s=pred.get("tokens_per_s"),
                     predicted_memory_bytes_per_rank=pred.get("memory_bytes_per_rank"),
                     predicted_memory_breakdown=breakdown or None,
                     predicted_memory_parts=parts or None,
                     # MFU's denominator (per rank) and numerator's FLOPs: dtorch.cluster.peak
                     mfu_peak_flops=peak, flops_per_token=fpt, world_size=tr.world)
    if tr.rank == 0 and tr.console:
        extra = ""
        if pred:
            extra = f" (predicted {pred.get('step_time_s', float('nan')) * 1e3:.0f} ms/step"
            if predicted_mfu is not None:
                extra += f", MFU {predicted_mfu:.1%}"
            extra += f"; per rank {memory_summary(breakdown, detail=False)})" if breakdown else ")"
        print(f"dtorch: plan {tr.plan.family()}: {tr.plan.describe()}{extra}", flush=True)


def device_peak(tr: Trainer) -> float:
    """One rank's peak FLOP/s in the plan's compute dtype, the MFU denominator (`dtorch.cluster.peak`,
    as the plan's MFU counts it): the spec sheet's of the slowest GPU in the job; on a CPU the peak
    detected from its features, shared by the node's ranks."""
    from dtorch.cluster.peak import compute_dtype, cpu_peak

    dtype = compute_dtype(tr.plan.param_dtype)
    if tr.device.type == "cuda":
        from dtorch.cluster import local_cluster

        return local_cluster(tr.world).slowest_group().device.mfu_peak(dtype)
    return cpu_peak(dtype).flops / (tr.env.local_world_size or tr.world)


def flops_per_token(tr: Trainer) -> float:
    """Training FLOPs per token: the profile's when the plan was searched, else 6 x parameters."""
    if tr.resolver.profile is not None:
        return tr.resolver.profile.flops_per_token
    if tr.plan_source is not None and tr.plan_source.flops_per_token is not None:
        return float(tr.plan_source.flops_per_token)
    from dtorch.parallel.parallelize import meta_model

    return 6.0 * sum(p.numel() for p in meta_model(tr.model_factory).parameters())


def build_optimizers(tr: Trainer) -> list[torch.optim.Optimizer]:
    """The spec's optimizer per model part, in device memory or in the offload tier. The NVMe
    directory is checked on every rank first and a bad one fails all ranks alike."""
    from dtorch.train import offload as tiers

    parts = tr.parallel.model_parts
    tr.offload = tiers.OptimizerOffload.resolve(tr.offload_request, tr.plan.offload, tr.offload_dir)
    if tr.offload is None:
        return [tr.optimizer_spec.build(p.parameters()) for p in parts]
    if tr.plan.offload == "params":
        raise ConfigError("offload", tr.offload_request, "the plan already offloads parameters, gradients and "
                          "optimizer state (offload=params, FSDP CPU offload); use one of the two")
    if tr.offload.tier == "nvme":
        error = None
        try:
            need = sum(tiers.bytes_needed(tr.optimizer_spec, p.parameters(), tr.offload) for p in parts)
            local = tr.env.local_world_size or 1
            tiers.check_directory(tr.offload.directory, need, tr.offload.budget_bytes,
                                  others_bytes=need * (local - 1))
        except ConfigError as e:
            error = (e.field, e.value if isinstance(e.value, (int, str, type(None))) else repr(e.value), e.fix)
        errors = [error]
        if dist.is_initialized():
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise ConfigError(*first)
        if tr.async_checkpoint and tr.ckpt is not None:
            # an async save copies every tensor into host memory first: the state the NVMe tier
            # keeps out of memory would come back at each checkpoint
            tr.async_checkpoint = False
            log.info("NVMe optimizer tier: checkpoints are written synchronously, straight from its files")
    opts = [tiers.build(tr.optimizer_spec, p.parameters(), tr.offload, tag=f"r{tr.rank}p{i}")
            for i, p in enumerate(parts)]
    from dtorch.plan.strategies.memory import step_overlaps_backward

    tier = "optimizer" if tr.offload.tier == "host" else "optimizer_nvme"
    overlap = tr.offload.overlap is not False and step_overlaps_backward(
        tr.plan, bool(tr.max_grad_norm), tier)
    if overlap:  # the CPU step of each block runs while the backward of the earlier ones does
        for o in opts:
            o.overlap_backward(tr.plan.num_microbatches)
    mem = [o.memory() for o in opts]
    tr.metrics.event("offload", tier=tr.offload.tier, directory=tr.offload.directory, overlap=overlap,
                       host_bytes=sum(m["host_bytes"] for m in mem), disk_bytes=sum(m["disk_bytes"] for m in mem),
                       buffer_bytes=sum(m["buffer_bytes"] for m in mem))
    return opts


def full_state_dict(tr: Trainer) -> dict[str, torch.Tensor] | None:
    """The whole model's weights as plain CPU tensors on rank 0 (None elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full: dict[str, torch.Tensor] = {}
    if dist.is_initialized():
        # torch keeps a cpu-offloaded full state dict on rank 0 only: under PP every rank's stage
        # is needed, so there each rank gathers its own and copies it to the CPU itself
        opts = StateDictOptions(full_state_dict=True, cpu_offload=tr.plan.pp == 1)
        for part in tr.parallel.model_parts:
            full.update({k: v.detach().cpu() for k, v in get_model_state_dict(part, options=opts).items()})
        if tr.plan.pp > 1:  # each pipeline rank holds other blocks: gather them on rank 0
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, full if tr.rank != 0 else {})
            for g in gathered:
                full.update(g or {})
    else:
        for part in tr.parallel.model_parts:
            full.update({k: v.detach().cpu() for k, v in part.state_dict().items()})
    from dtorch.parallel.materialize import clean_name

    return {clean_name(k): v for k, v in full.items()} if tr.rank == 0 else None


def checkpoint_extra(tr: Trainer) -> dict[str, Any]:
    """What a checkpoint records beside the state: the tokens seen, and what a resumed run should keep
    to continue the same run (the schedule over its steps, the held-out split); `resume_changes`."""
    import dataclasses

    spec, out = tr.lr_spec, {"tokens_seen": tr.train_state.tokens_seen}
    # the sample stream (`GlobalSampler`): its order is a function of these three and the step
    s = tr.sampler
    out.update(dataset_samples=s.num_samples, global_batch=s.global_batch, seed=s.seed)
    if dataclasses.is_dataclass(spec):  # compact (`dtorch ckpt ls` shows it): WSD(warmup_steps=20,...)/300
        fields = ",".join(f"{k}={v}" for k, v in dataclasses.asdict(spec).items() if v is not None)
        out["lr_schedule"] = f"{type(spec).__name__}({fields})/{tr.resolver.fit_steps}"
    if tr.eval_spec is not None and tr.eval_spec.split is not None:
        out["eval_split"] = tr.eval_spec.split
    return out


def resume_changes(tr: Trainer, extra: dict[str, Any]) -> list[str]:
    """How this run differs from the checkpoint it resumed in what `checkpoint_extra` records (a
    checkpoint that did not record it is not compared)."""
    mine, out = checkpoint_extra(tr), []
    if extra.get("lr_schedule") and mine.get("lr_schedule") and extra["lr_schedule"] != mine["lr_schedule"]:
        out.append(f"the learning-rate schedule changed: {extra['lr_schedule']} -> {mine['lr_schedule']}")
    if extra.get("lr_schedule") and extra.get("eval_split") != mine.get("eval_split"):  # (a checkpoint of this code)
        out.append(f"the held-out eval split changed ({extra.get('eval_split')} -> {mine.get('eval_split')}): the "
                   "training order changes, and samples now held out may have been trained on before")
    said = {"dataset_samples": "the dataset's size in samples", "global_batch": "the global batch", "seed": "the seed"}
    for key in [k for k in said if k in extra and extra[k] != mine[k]]:
        out.append(f"{said[key]} changed ({extra[key]:,} -> {mine[key]:,}): from here the samples follow another "
                   "order than the checkpointed run's (samples may repeat or be skipped)")
    return out


class SchedulersState:
    """LR schedulers of all model parts (identical schedules); saved once."""

    def __init__(self, schedulers: list):
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        sd = self.schedulers[0].state_dict()
        return {k: v for k, v in sd.items() if k != "lr_lambdas"}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for s in self.schedulers:
            cur = s.state_dict()
            cur.update({k: v for k, v in sd.items() if k in cur})
            s.load_state_dict(cur)
