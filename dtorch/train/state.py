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
            fill_missing_state(opt)
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


@torch.no_grad()
def fill_missing_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every trainable parameter that has no optimizer state yet (a branch no step has taken)
    the state its first real step would start from, so that every checkpoint holds the same keys
    and a resume's template matches it. The state comes from the optimizer's own code: one step of
    zero gradients at lr 0 and weight decay 0 over those parameters alone, its step count set back
    to 0 (AdamW: zero moments, step 0, exactly its lazy initialisation; SGD: a zero momentum buffer,
    which its first step turns into the gradient, as a fresh one). Nothing else moves."""
    groups = optimizer.param_groups
    missing = {p for g in groups for p in g["params"] if p.requires_grad and p not in optimizer.state}
    if not missing or len(missing) == sum(len(g["params"]) for g in groups):
        return  # everything has state, or nothing does (torch's own state-dict helpers fill that case)
    saved_grads = {p: p.grad for g in groups for p in g["params"]}
    saved_hyper = [{k: g[k] for k in ("lr", "weight_decay") if k in g} for g in groups]
    try:
        for p in saved_grads:
            p.grad = torch.zeros_like(p) if p in missing else None
        for g in groups:
            g["lr"] = g["lr"] * 0 if isinstance(g["lr"], torch.Tensor) else 0.0
            if "weight_decay" in g:
                g["weight_decay"] = 0.0
        optimizer.step()
    finally:
        for p, grad in saved_grads.items():
            p.grad = grad
        for g, hyper in zip(groups, saved_hyper):
            g.update(hyper)
    for p in missing:
        step = optimizer.state[p].get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            optimizer.state[p]["step"] = 0
