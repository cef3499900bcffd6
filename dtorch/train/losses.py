"""Losses: `loss(output, target) -> mean loss of one micro-batch` (a 0-d tensor).

The loss is called with what the model returned, read by `dtorch.model.outputs.logits_of`
(`.logits` of a transformers output, a dict's "logits", a tuple's first element, else the output
itself) and the batch's target (docs/models.md). Any callable of that form works, e.g.
`torch.nn.functional.mse_loss`.

`next_token` (the default) is cross entropy over the last dimension: for a language model the
labels are already the next tokens (the data pipeline shifts them), with -100 for positions to
ignore; for a classifier, logits [b, C] and integer labels [b]. The softmax is float32 whatever the
logits' dtype. On plain tensors it is `dtorch.model.loss.cross_entropy`, which keeps the logits
rather than float32 log-probabilities for the backward (a third of the loss's memory at 16 bits);
on vocabulary-sharded DTensor logits, inside `torch.distributed.tensor.parallel.loss_parallel()`
(the executor enters that context when the plan uses tensor parallelism), it is torch's
`F.cross_entropy` of the upcast logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from dtorch.model.loss import cross_entropy as _chunked

IGNORE_INDEX = -100


def next_token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all non-ignored positions: logits [..., C], labels [...]
    (a language model's [b, s, V] and [b, s]; a classifier's [b, C] and [b])."""
    flat, target = logits.flatten(0, -2), labels.flatten()
    if isinstance(flat, DTensor) or isinstance(target, DTensor):
        return F.cross_entropy(flat.float(), target, ignore_index=IGNORE_INDEX)
    return _chunked(flat, target, IGNORE_INDEX)


cross_entropy = next_token
"""The same function under the name a classifier reads better with."""
