"""Losses: `loss(logits, labels) -> mean loss of one micro-batch` (a 0-d tensor).

Labels are already the next tokens (the data pipeline shifts them), with -100 for positions to
ignore. The logits are upcast to float32 for the softmax. The loss works on plain tensors and,
inside `torch.distributed.tensor.parallel.loss_parallel()`, on vocabulary-sharded DTensor logits
(the executor enters that context when the plan uses tensor parallelism).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def next_token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all non-ignored positions; logits [b, s, V], labels [b, s]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX)
