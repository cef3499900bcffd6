"""Cross entropy that keeps the logits, not their float32 log-probabilities.

`cross_entropy(logits [N, C], labels [N], ignore_index)` is `F.cross_entropy(logits.float(), labels,
ignore_index=..., reduction="mean")` computed in row chunks of `LOSS_CHUNK_ELEMENTS` float32 elements
(`dtorch.model.analytic.loss_chunk_rows`). The forward keeps the logits as they came (the compute
dtype), the labels and one float32 log-sum-exp per row; the backward forms the softmax one chunk at
a time into a gradient of the logits' dtype (for 16-bit logits through a float32 chunk beside it).
Per token that is the logits (2 C bytes at 16 bits) and their gradient, where torch's keeps 4 C
bytes of float32 log-probabilities and holds 8 C more in its backward (those and the upcast logits'
gradient). The same float32 softmax per row, so the result equals torch's to float32 rounding. The
model's profile (`dtorch.model.profiler`) measures with it and the memory model
(`dtorch.plan.strategies.memory`) prices it.
"""

from __future__ import annotations

import torch

from dtorch.model.analytic import loss_chunk_rows


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        keep = labels != ignore_index
        safe = torch.where(keep, labels, 0).unsqueeze(1)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        picked = torch.empty_like(lse)
        step = loss_chunk_rows(logits.shape[1])
        for i in range(0, logits.shape[0], step):
            x = logits[i:i + step].float()
            lse[i:i + step] = torch.logsumexp(x, dim=1)
            picked[i:i + step] = x.gather(1, safe[i:i + step]).squeeze(1)
        ctx.ignore_index = ignore_index
        ctx.save_for_backward(logits, labels, lse)
        return torch.where(keep, lse - picked, 0.0).sum() / keep.sum()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        keep = labels != ctx.ignore_index
        safe = torch.where(keep, labels, 0).unsqueeze(1)
        scale = keep.float() * (grad_out.float() / keep.sum())
        grad = torch.empty_like(logits)
        step = loss_chunk_rows(logits.shape[1])
        wide = logits.dtype == torch.float32  # (then the chunk is formed in the gradient itself)
        for i in range(0, logits.shape[0], step):
            rows = slice(i, i + step)
            if wide:
                x = torch.sub(logits[rows], lse[rows, None], out=grad[rows])
            else:  # (a float32 copy of the chunk, changed in place)
                x = logits[rows].float().sub_(lse[rows, None])
            x.exp_()  # the softmax
            x.scatter_add_(1, safe[rows], torch.full_like(safe[rows], -1, dtype=torch.float32))
            x.mul_(scale[rows, None])
            if not wide:
                grad[rows].copy_(x)
        return grad, None, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy of logits [N, C] against integer labels [N] (rows labelled `ignore_index`
    left out; NaN when every row is), the softmax in float32 whatever the logits' dtype."""
    return _ChunkedCrossEntropy.apply(logits, labels, ignore_index)
