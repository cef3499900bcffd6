"""Checkpointable pieces of a training run (DCP `Stateful`s).

Model and optimizer state use PyTorch's `torch.distributed.checkpoint.state_dict` helpers so that
keys are the unsplit model's fully qualified names whatever the plan: a checkpoint written under
FSDPxTP at 4 ranks loads under FSDP at 2 ranks (DCP reshards the tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

# Flattened optimizer state ("state.<fqn>.exp_avg") merges across pipeline chunks without clashes.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelState:
    """This rank's model parts; keys are unsplit-model FQNs."""

    def __init__(self, parallel: Any):
        self.parallel = parallel

    def state_dict(self) -> dict[str, Any]:
        return self.parallel.state_dict_for_checkpoint()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        opts = StateDictOptions(strict=False)
        for part in self.parallel.model_parts:
            if dist.is_initialized():
                set_model_state_dict(part, sd, options=opts)
            else:  # checkpoint keys are clean names; the part's may hold torch.compile's `_orig_mod.`
                from dtorch.parallel.materialize import clean_name

                own = {k: clean_name(k) for k in part.state_dict()}
                part.load_state_dict({k: sd[c] for k, c in own.items() if c in sd}, strict=False)


class OptimizerState:
    """One optimizer per model part, saved as one flat dict."""

    def __init__(self, parallel: Any, optimizers: list[torch.optim.Optimizer]):
        self.parallel = parallel
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for part, opt in zip(self.parallel.model_parts, self.optimizers):
            sd.update(get_optimizer_state_dict(part, opt, options=_FLAT))
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for part, opt in zip(self.parallel.model_parts, self.optimizers):
            set_optimizer_state_dict(part, opt, sd, options=_FLAT)


@dataclass
class TrainState:
    """The global step (which is also the data position: the sampler is a function of it)."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.tokens_seen = int(sd["tokens_seen"])
