"""How DTorch calls a model and reads what it returns: one rule for the profiler and the executor.

A model input is a tensor, a tuple / list of tensors (positional arguments) or a dict of tensors
(keyword arguments): `call_model` calls `model(x)`, `model(*x)` or `model(**x)`. What the loss
receives is `logits_of(output)`: `output.logits` (a transformers `ModelOutput`, any object with
`.logits`), `output["logits"]` (a dict), the first element of a tuple / list, else the output itself.
See docs/models.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten


def call_model(model: nn.Module, inputs: Any) -> Any:
    """`model` applied to one batch of model input (a tensor, a tuple/list, or a dict)."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def logits_of(output: Any) -> Any:
    """What the loss is called with (the module docstring's rule)."""
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict) and "logits" in output:
        return output["logits"]
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    return output


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors of a nested tensor / tuple / list / dict, in pytree order."""
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def batch_size(obj: Any) -> int:
    """Samples in a batch: dim 0 of its first tensor (0 when it holds none)."""
    leaves = [t for t in tensor_leaves(obj) if t.dim() > 0]
    return int(leaves[0].shape[0]) if leaves else 0


def is_token_input(inputs: Any) -> bool:
    """A batch of token sequences: one integer tensor [batch, seq] (what pipeline and context
    parallelism can split); anything else is another kind of input."""
    return (isinstance(inputs, torch.Tensor) and inputs.dim() == 2
            and not inputs.is_floating_point() and not inputs.is_complex() and inputs.dtype != torch.bool)
