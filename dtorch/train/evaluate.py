"""Evaluation: what is evaluated on (`EvalSpec`, a held-out split of the training data) and the
loss of one evaluation under the run's parallel plan (`eval_loss`).

The evaluation set is `eval_data`, or without it the samples a seeded permutation of the training
set holds out (`held_out_split`): the trainer then trains on the rest only, so a held-out sample is
never trained on. An evaluation reads the set in order, in global batches of the run's
`global_batch` samples cut among the data-parallel ranks exactly as a training batch is, runs the
model in eval mode without gradients through the same parallel plan (the pipeline schedule's
forward-only `eval` under PP), and averages the loss over ranks as training does: each
micro-batch's mean loss, summed over the world and divided by the ranks that hold the last stage.
The callback that runs it is `dtorch.train.callbacks.Evaluate`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dtorch.errors import ConfigError

DEFAULT_SPLIT = 0.05
"""The fraction of the training samples held out when evaluation is asked without eval data."""


@dataclass(frozen=True)
class EvalSpec:
    """What evaluation a run asked for (`resolve`: None when it asked for none)."""

    every: int
    """Steps between evaluations (0: once, at the end)."""
    split: float | None
    """The fraction of the training data held out, or None (eval data given)."""
    batches: int | None
    """Global batches per evaluation (None: the whole evaluation set)."""

    @staticmethod
    def resolve(every: int | None, data: Any, split: float | None, batches: int | None) -> EvalSpec | None:
        """The spec of `eval_every`, `eval_data`, `eval_split`, `eval_batches` (ConfigError naming a
        bad value), or None: evaluation is on when any of every, data or split is given."""
        every = int(every or 0)
        if every < 0:
            raise ConfigError("eval_every", every, "evaluate every N >= 1 steps, or 0 for at the end only")
        if batches is not None and int(batches) < 1:
            raise ConfigError("eval_batches", batches, "use 1 or more batches per evaluation, or leave it unset "
                              "for the whole evaluation set")
        if split is not None:
            if data is not None:
                raise ConfigError("eval_split", split, "give eval data or a held-out split of the training data, "
                                  "not both")
            if not 0.0 < float(split) < 1.0:
                raise ConfigError("eval_split", split, "the fraction of the training samples held out: in (0, 1), "
                                  "e.g. 0.05")
        if not every and data is None and split is None:
            if batches is not None:
                raise ConfigError("eval_batches", batches, "evaluation is off: give eval_every, eval_data or "
                                  "eval_split too")
            return None
        if data is None and split is None:
            split = DEFAULT_SPLIT
        return EvalSpec(every, float(split) if split is not None else None,
                        int(batches) if batches is not None else None)


class Subset(torch.utils.data.Dataset):
    """Samples `indices` of `base`, in that order; other attributes (vocab_size, tokenizer, ...) are
    the base dataset's."""

    def __init__(self, base: Any, indices: list[int]):
        self.base, self.indices = base, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.base[self.indices[int(i)]]

    def __getattr__(self, name: str) -> Any:
        if name in ("base", "indices") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.base, name)


def held_out_split(dataset: Any, fraction: float, seed: int) -> tuple[Subset, Subset]:
    """(training samples, held-out samples) of `dataset`: a seeded permutation's first
    ``round(fraction * len)`` samples (at least one) are held out; both keep index order."""
    n = len(dataset)
    k = max(1, round(n * fraction))
    if k >= n:
        raise ConfigError("eval_split", fraction, f"it holds out {k} of the {n} training samples, leaving none to "
                          "train on; use a smaller fraction or pass eval data")
    # a stream of its own (not the sampler's (seed, epoch) ones): numpy's stable PCG64
    perm = np.random.Generator(np.random.PCG64([int(seed), 0x65766C])).permutation(n)
    held = np.zeros(n, dtype=bool)
    held[perm[:k]] = True
    return Subset(dataset, np.flatnonzero(~held).tolist()), Subset(dataset, np.flatnonzero(held).tolist())


def batch_count(eval_set: Any, global_batch: int, batches: int | None, field: str) -> int:
    """Global batches per evaluation: `batches`, at most what the set holds (ConfigError when it
    holds less than one)."""
    whole = len(eval_set) // int(global_batch)
    if whole < 1:
        raise ConfigError(field, f"{len(eval_set)} evaluation samples",
                          f"an evaluation batch is one global batch of {global_batch} samples: give more evaluation "
                          "data (a larger eval_split) or a smaller global_batch")
    return min(whole, batches) if batches else whole


def datasets(tr: Any) -> tuple[Any, Any]:
    """(training set, evaluation set or None) of a trainer: its data (the default corpus without),
    less the held-out split when one is asked, and the split or its eval data."""
    data = tr.data
    if data is None:
        from dtorch.train.data import default_corpus

        data = default_corpus(tr.seq_len)
    if tr.eval_spec is not None and tr.eval_spec.split is not None:
        return held_out_split(data, tr.eval_spec.split, tr.seed)
    return data, tr.eval_data


def eval_batches(tr: Any) -> int:
    """A trainer's global batches per evaluation (ConfigError when its set holds less than one)."""
    field = "eval_data" if tr.eval_data is not None else "eval_split"
    return batch_count(tr._datasets()[1], tr.global_batch, tr.eval_spec.batches, field)


def local_indices(b: int, global_batch: int, dp_rank: int, dp_size: int, shares: list[int] | None) -> list[int]:
    """This data-parallel rank's samples of evaluation batch `b`: its slice of samples
    ``[b * global_batch, (b + 1) * global_batch)``, cut as the training sampler cuts a step."""
    start = b * global_batch
    if shares is None:
        per = global_batch // dp_size
        return list(range(start + dp_rank * per, start + (dp_rank + 1) * per))
    first = start + sum(shares[:dp_rank])
    return list(range(first, first + shares[dp_rank]))


def can_evaluate(parallel: Any) -> str | None:
    """Why this plan cannot evaluate (None: it can)."""
    if parallel.schedule is not None and not hasattr(parallel.schedule, "eval"):
        return ("this torch's pipeline schedules have no forward-only eval path (torch >= 2.6 has one); "
                "evaluate with a plan with pp=1 or upgrade torch")
    return None


@torch.no_grad()
def eval_loss(tr: Any, eval_set: Any, batches: int, phase: Any = None) -> float:
    """The mean loss over `batches` global batches of `eval_set` under the trainer's plan (every rank
    calls it; identical on every rank). `phase()` is called before each batch (the heartbeat)."""
    import torch.distributed as dist

    from dtorch.parallel.model import uneven_shares
    from dtorch.train.data import batch_for

    p = tr.parallel
    plan = p.plan
    shares = [plan.microbatch_size * n for n in plan.dp_shares] if uneven_shares(plan) else None
    parts = p.model_parts
    modes = [part.training for part in parts]
    for part in parts:
        part.eval()
    total = torch.zeros((), device=p.device)
    try:
        for b in range(batches):
            if phase is not None:
                phase()
            idx = local_indices(b, tr.global_batch, p.dp_rank, p.dp_size, shares)
            inputs, labels = batch_for(eval_set, idx, tr.collate)
            total += p.eval_local_loss(inputs, labels)
    finally:
        for part, mode in zip(parts, modes):
            part.train(mode)
        _reshard(parts)
    if p.distributed:
        dist.all_reduce(total)
        total = total / (dist.get_world_size() // plan.pp)
    return float(total.cpu()) / batches


def _reshard(parts: list) -> None:
    """FSDP2 keeps a no-grad forward's gathered weights when reshard_after_forward is off (a backward
    would free them): free them now, as the next step's forward gathers them again."""
    from torch.distributed.fsdp import FSDPModule

    for part in parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                with contextlib.suppress(Exception):
                    m.reshard()
