"""The chunked cross entropy (`dtorch.model.loss`) against torch's, and what it keeps for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtorch.model import analytic
from dtorch.model.loss import cross_entropy
from dtorch.train.losses import IGNORE_INDEX, next_token


def _pair(dtype, rows, classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, classes, generator=g) * 3).to(dtype)
    y = torch.randint(0, classes, (rows,), generator=g)
    y[::5] = IGNORE_INDEX
    return x, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [analytic.LOSS_CHUNK_ELEMENTS, 7 * 50])  # one chunk; 7 rows each
def test_equals_torch_cross_entropy_of_the_upcast_logits(dtype, chunk_elements, monkeypatch):
    monkeypatch.setattr(analytic, "LOSS_CHUNK_ELEMENTS", chunk_elements)
    x, y = _pair(dtype, 37, 50)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, theirs = cross_entropy(a, y), F.cross_entropy(b.float(), y, ignore_index=IGNORE_INDEX)
    (1.7 * ours).backward()
    (1.7 * theirs).backward()
    assert ours.dtype == torch.float32
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    assert a.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # (bfloat16: one rounding of the same float32 value)
    torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=tol, atol=tol * b.grad.abs().max().item())
    assert a.grad[::5].abs().max() == 0  # ignored rows have no gradient


def test_every_row_ignored_is_nan_as_torch():
    x, y = torch.randn(4, 3), torch.full((4,), IGNORE_INDEX)
    assert torch.isnan(cross_entropy(x, y)) and torch.isnan(F.cross_entropy(x, y, ignore_index=IGNORE_INDEX))


def test_keeps_the_logits_not_float32_log_probabilities():
    """What autograd keeps for the backward: the logits themselves (no copy), the labels and a float32
    log-sum-exp per row; torch's keeps a float32 log-softmax of the upcast logits, 4 B per element."""
    x, y = _pair(torch.bfloat16, 64, 1000)
    x.requires_grad_()

    def saved_bytes(loss_fn) -> tuple[int, bool]:
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_fn(x.view(8, 8, 1000), y.view(8, 8))
        return sum(seen.values()), x.untyped_storage().data_ptr() in seen

    ours, shares = saved_bytes(next_token)
    theirs, _ = saved_bytes(lambda lg, lb: F.cross_entropy(lg.flatten(0, 1).float(), lb.flatten()))
    assert shares and ours == 64 * 1000 * 2 + 64 * 8 + 64 * 4  # logits (bf16), labels, log-sum-exp
    assert theirs >= 64 * 1000 * 4
