"""A global sampler whose position is a pure function of the step.

The sample stream is infinite: position ``p`` (a count of samples consumed since step 0) lies in
epoch ``p // num_samples`` at offset ``p % num_samples``, and maps to
``permutation(seed, epoch)[offset]``. Step ``s`` consumes positions ``[s * global_batch,
(s + 1) * global_batch)``. Data-parallel rank ``r`` of ``d`` takes the contiguous slice
``[r * b, (r + 1) * b)`` of the step's global batch, ``b = global_batch // d``; with uneven
shares (a plan's `dp_shares`, mixed devices) rank ``r`` takes ``[s_0 + ... + s_{r-1}, s_0 + ... +
s_r)`` samples, ``s_i`` being rank i's share in samples: the same global batch, cut elsewhere.

Because nothing but the step is state, a run resumed at another data-parallel size consumes
exactly the same global sequence of samples (torchtitan's per-rank loader state cannot do this).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from dtorch.errors import ConfigError


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class GlobalSampler:
    """Deterministic global sample order for `num_samples` samples, `global_batch` per step.

    Every epoch is a fresh permutation drawn from ``(seed, epoch)``: no sample repeats within an
    epoch, and epochs differ. A global batch may straddle two epochs (the stream never drops
    samples). Permutations are cached for the two most recent epochs (``num_samples`` int64 each).
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int = 0):
        if int(num_samples) < 1:
            raise ConfigError("num_samples", num_samples, "the dataset must hold at least one sample")
        if int(global_batch) < 1:
            raise ConfigError("global_batch", global_batch, "use a positive number of samples per step")
        if int(seed) < 0:
            raise ConfigError("seed", seed, "use a non-negative integer seed")
        self.num_samples = int(num_samples)
        self.global_batch = int(global_batch)
        self.seed = int(seed)
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    # ---- pure position arithmetic ---------------------------------------------------------------
    def epoch_of(self, step: int) -> int:
        """The epoch in which `step`'s first sample lies."""
        return (int(step) * self.global_batch) // self.num_samples

    def sample_offset(self, step: int) -> int:
        """Samples consumed before `step` (the stream position where `step` starts)."""
        return int(step) * self.global_batch

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch` (int64 array of length num_samples)."""
        perm = self._perms.get(epoch)
        if perm is None:
            # SeedSequence([seed, epoch]) + PCG64 is numpy's stable, documented stream.
            perm = np.random.Generator(np.random.PCG64([self.seed, int(epoch)])).permutation(self.num_samples)
            self._perms[epoch] = perm
            while len(self._perms) > 2:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def indices_at(self, offset: int, count: int) -> list[int]:
        """`count` sample indices starting at stream position `offset` (samples since step 0)."""
        if offset < 0 or count < 0:
            raise ConfigError("offset", (offset, count), "stream positions and counts are non-negative")
        out: list[int] = []
        pos, end = int(offset), int(offset) + int(count)
        while pos < end:
            epoch, start = divmod(pos, self.num_samples)
            take = min(end - pos, self.num_samples - start)
            out.extend(self.permutation(epoch)[start : start + take].tolist())
            pos += take
        return out

    # ---- per step ------------------------------------------------------------------------------
    def global_indices(self, step: int) -> list[int]:
        """The global batch of `step` (length global_batch)."""
        if int(step) < 0:
            raise ConfigError("step", step, "steps count from 0")
        return self.indices_at(self.sample_offset(step), self.global_batch)

    def local_batch(self, dp_size: int) -> int:
        """Samples per data-parallel rank per step; `dp_size` must divide global_batch."""
        if int(dp_size) < 1 or self.global_batch % int(dp_size):
            raise ConfigError(
                "dp_size",
                dp_size,
                f"the data-parallel size must divide global_batch={self.global_batch}; "
                f"use one of {_divisors(self.global_batch)} or change global_batch",
            )
        return self.global_batch // int(dp_size)

    def local_indices(self, step: int, dp_rank: int, dp_size: int,
                      shares: list[int] | None = None) -> list[int]:
        """Rank `dp_rank`'s contiguous slice of `step`'s global batch: an even slice, or with
        `shares` (samples per data-parallel rank, `dp_size` of them summing to global_batch) the
        slice its share gives."""
        if not 0 <= int(dp_rank) < int(dp_size):
            raise ConfigError("dp_rank", dp_rank, f"use a rank in [0, {dp_size})")
        g = self.global_indices(step)
        if shares is None:
            b = self.local_batch(dp_size)
            return g[int(dp_rank) * b : (int(dp_rank) + 1) * b]
        shares = [int(n) for n in shares]
        if len(shares) != int(dp_size) or sum(shares) != self.global_batch or min(shares) < 1:
            raise ConfigError("shares", shares, f"give {dp_size} positive sample counts (one per data-parallel "
                              f"rank) that sum to global_batch={self.global_batch}")
        start = sum(shares[: int(dp_rank)])
        return g[start : start + shares[int(dp_rank)]]

    # ---- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The sampler's identity (the position is the trainer's step, stored next to it)."""
        return {"num_samples": self.num_samples, "global_batch": self.global_batch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check that a resumed run draws from the same stream (same dataset size and seed).

        A changed global batch is accepted: a trainer that changes it must resume from the saved
        sample offset with `indices_at` rather than from ``step * global_batch``."""
        for key in ("num_samples", "seed"):
            if int(state[key]) != getattr(self, key):
                raise ConfigError(
                    f"sampler.{key}",
                    getattr(self, key),
                    f"the checkpoint was written with {key}={state[key]}; resume with the same dataset and seed",
                )
