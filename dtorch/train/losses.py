"""Losses: `loss(output, target) -> mean loss of one micro-batch` (a 0-d tensor).

The loss is called with what the model returned, read by `dtorch.model.outputs.logits_of`
(`.logits` of a transformers output, a dict's "logits", a tuple's first element, else the output
itself) and the batch's target (docs/models.md). Any callable of that form works, e.g.
`torch.nn.functional.mse_loss`.

`next_token` (the default) is cross entropy over the last dimension: for a language model the
labels are already the next tokens (the data pipeline shifts them), with -100 for positions to
ignore; for a classifier, logits [b, C] and integer labels [b]. The logits are upcast to float32
for the softmax. It works on plain tensors and, inside
`torch.distributed.tensor.parallel.loss_parallel()`, on vocabulary-sharded DTensor logits (the
executor enters that context when the plan uses tensor parallelism).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def next_token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all non-ignored positions: logits [..., C], labels [...]
    (a language model's [b, s, V] and [b, s]; a classifier's [b, C] and [b])."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX)


cross_entropy = next_token
"""The same function under the name a classifier reads better with."""
