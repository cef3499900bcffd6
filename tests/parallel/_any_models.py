"""Models DTorch did not write, and their data: what a user brings (docs/models.md).

- `cnn`: a CNN classifier as ONE nn.Sequential (stem, a run of residual blocks, pooling, head) on
  float32 images [3, 16, 16] with integer labels (items: (image, label)).
- `vit`: a tiny ViT of the user's own (patch embedding, `encoder.layers` of pre-norm attention
  blocks calling scaled_dot_product_attention, classification head); items are dicts
  {"pixel_values", "label"}: the model is called with pixel_values=...
- `mlp`: an MLP regressor on float features with MSE loss: no repeated blocks.
- `branchy`: blocks that pick a branch per sample by the input's sign (so on a rank whose samples
  all take one branch the other branch's parameters get no gradient) and a custom
  autograd.Function with a parameter.

Group norm, not batch norm: a batch statistic would make data-parallel ranks differ from one
process by construction.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NUM_CLASSES = 10
NUM_SAMPLES = 64


class ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.GroupNorm(2, c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.relu(self.norm(self.conv1(x))))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), ResBlock(8), ResBlock(8), ResBlock(8),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, NUM_CLASSES))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Encoder(nn.Module):
    def __init__(self, dim: int, heads: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList([EncoderBlock(dim, heads) for _ in range(depth)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class ViT(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, depth: int = 2, patch: int = 4, image: int = 16):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2, dim) * 0.02)
        self.encoder = Encoder(dim, heads, depth)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, NUM_CLASSES)

    def forward(self, pixel_values):
        x = self.patch(pixel_values).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.norm(self.encoder(x)).mean(dim=1))


def vit() -> nn.Module:
    return ViT()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


class ScaleFn(torch.autograd.Function):
    """y = x * w (w a parameter vector), with a hand-written backward."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).reshape(-1, w.shape[-1]).sum(0)


class BranchBlock(nn.Module):
    """Each sample goes through `pos` or `neg` by the sign of the model input's first feature:
    a branch no sample of the batch takes is not run, its parameters get no gradient."""

    def __init__(self, dim: int):
        super().__init__()
        self.pos = nn.Linear(dim, dim)
        self.neg = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x, pick):
        out = torch.zeros_like(x)
        if pick.any():
            out = out.index_put((pick,), torch.tanh(self.pos(x[pick])))
        if (~pick).any():
            out = out.index_put((~pick,), torch.tanh(self.neg(x[~pick])))
        return x + ScaleFn.apply(out, self.scale)


class Branchy(nn.Module):
    def __init__(self, features: int = 8, dim: int = 16, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(features, dim)
        self.blocks = nn.ModuleList([BranchBlock(dim) for _ in range(depth)])
        self.out = nn.Linear(dim, NUM_CLASSES)

    def forward(self, x):
        pick = x[:, 0] > 0
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, pick)
        return self.out(h)


def branchy() -> nn.Module:
    return Branchy()


# ---- data: map-style datasets (lists), deterministic -------------------------------------------------
def images(n: int = NUM_SAMPLES) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, 16, 16, generator=g)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=g)
    return [(x[i], int(y[i])) for i in range(n)]


def image_dicts(n: int = NUM_SAMPLES) -> list[dict]:
    return [{"pixel_values": x, "label": torch.tensor(y)} for x, y in images(n)]


def regression(n: int = NUM_SAMPLES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return [(x[i], y[i]) for i in range(n)]


def branch_data(signs: list[float]) -> list[tuple[torch.Tensor, int]]:
    """Features whose first entry has the given sign per sample (the branch each sample takes)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(len(signs), 8, generator=g)
    x[:, 0] = x[:, 0].abs() * torch.tensor(signs) + 0.1 * torch.tensor(signs)
    y = torch.randint(0, NUM_CLASSES, (len(signs),), generator=g)
    return [(x[i], int(y[i])) for i in range(len(signs))]


MODELS = {"cnn": (cnn, images, "cross_entropy"), "vit": (vit, image_dicts, "cross_entropy"),
          "mlp": (mlp, regression, "mse"), "branchy": (branchy, None, "cross_entropy")}


def loss_fn(kind: str):
    from dtorch.train.losses import cross_entropy

    return cross_entropy if kind == "cross_entropy" else F.mse_loss
