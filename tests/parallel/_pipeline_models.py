"""Hand-written models for the pipeline tests, under their own names, and the training loop both
sides of the comparison run (5 AdamW steps in float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH = 64, 16, 32
STEPS, BATCH, LR = 5, 4, 3e-3


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), CausalSelfAttention(d, n_head)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class HandGPT(nn.Module):
    """nanoGPT's shape: blocks in an nn.ModuleList called `h`, learned positions, untied head
    (`tied`: the head shares the embedding's weight; `skip`: the head also reads the embedding)."""

    def __init__(self, n_layer: int = 4, n_head: int = 4, d: int = WIDTH, tied: bool = False, skip: bool = False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.h = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.skip = skip
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        emb = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        x = emb
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x + emb if self.skip else x)


class Residual(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class MLPStack(nn.Module):
    """A regressor: an input layer, an nn.Sequential of identical residual blocks, an output layer."""

    def __init__(self, d_in: int = 8, d: int = WIDTH, n_layer: int = 4):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.Sequential(*(Residual(d) for _ in range(n_layer)))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


class SmallCNN(nn.Module):
    """An image classifier without attention: a stem, identical conv blocks, a linear head."""

    def __init__(self, classes: int = 10, c: int = 8, n_layer: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.layers = nn.ModuleList(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU()) for _ in range(n_layer))
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.fc(x.mean((2, 3)))


def hand_gpt() -> nn.Module:
    return HandGPT()


def hand_gpt_skip() -> nn.Module:
    return HandGPT(skip=True)


def hand_gpt_tied() -> nn.Module:
    return HandGPT(tied=True)


def mlp_stack() -> nn.Module:
    return MLPStack()


def small_cnn() -> nn.Module:
    return SmallCNN()


FACTORIES = {"gpt": hand_gpt, "gpt_tied": hand_gpt_tied, "mlp": mlp_stack}


def batch(model: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if model.startswith("gpt"):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g)


def loss_fn(model: str):
    from dtorch.train.losses import next_token

    return next_token if model.startswith("gpt") else F.mse_loss


def train_single(model: str) -> list[float]:
    """Per-step losses of one process training the whole batch."""
    torch.manual_seed(0)  # what the executor's seed path builds (materialize.py)
    net = FACTORIES[model]()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        x, y = batch(model, step)
        loss = loss_fn(model)(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss.detach()))
    return out


def train_parallel(case: tuple[str, dict], rank: int) -> dict:
    """Per-step losses of the same training under the plan `case[1]` (plus its "model")."""
    from dtorch.parallel import parallelize
    from dtorch.plan.plan import Plan

    kwargs = dict(case[1])
    model = kwargs.pop("model")
    plan = Plan(**kwargs)
    x0, _ = batch(model, 0)
    pm = parallelize(FACTORIES[model], plan, loss_fn=loss_fn(model), seed=0, sample=(x0[:plan.microbatch_size],))
    opt = torch.optim.AdamW(list(pm.parameters()), lr=LR, foreach=False)
    losses = []
    for step in range(STEPS):
        x, y = batch(model, step)
        losses.append(float(pm.forward_backward(x, y)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses}
