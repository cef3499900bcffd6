"""Tied models for test_tied.py: a nanoGPT-style GPT written as a user would (its own names, its
head's weight assigned from the token embedding) and transformers' GPT2LMHeadModel with its
default config (tie_word_embeddings=True); the plain PyTorch loop they are held to; the
multi-process worker that trains, checks the tie, saves and reloads."""

from __future__ import annotations

import os
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from dtorch.plan.plan import Plan
from dtorch.train.losses import next_token

STEPS = 5
SEQ = 16
VOCAB = 256
LR = 3e-3
TIES = {"nanogpt": ("wte.weight", "lm_head.weight"), "hf-gpt2": ("tok_embeddings.weight", "output.weight")}


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's shape: wte, wpe, h, ln_f, lm_head, with `lm_head.weight = wte.weight`."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64, layers: int = 4, heads: int = 4, block_size: int = 64):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, n_embd=dim, n_layer=layers, n_head=heads,
                                      block_size=block_size)
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.h = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT does

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def factory(name: str) -> nn.Module:
    if name == "nanogpt":
        return NanoGPT()
    from transformers import GPT2Config, GPT2LMHeadModel

    assert name == "hf-gpt2"
    return GPT2LMHeadModel(GPT2Config(  # tie_word_embeddings: its default (True)
        vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1))


def batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def plain_loop(name: str, global_batch: int, seed: int = 0) -> dict:
    """The user's own loop: seed, construct on CPU, AdamW, the UNMODIFIED model (no adapter).
    {"losses": per step, "tied_grad": the tied weight's first-step gradient (both uses)}."""
    torch.manual_seed(seed)
    model = factory(name)
    tied = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else model.wte.weight
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grad = [], None
    for step in range(STEPS):
        x, y = batch(step, global_batch)
        out = model(x)
        loss = next_token(getattr(out, "logits", out), y)
        loss.backward()
        grad = tied.grad.clone() if grad is None else grad
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "tied_grad": grad}


def fingerprint(t: torch.Tensor) -> list[float]:
    """Whole-tensor values in two numbers (float64 sum, index-weighted sum): equal values, equal prints."""
    t = _full(t).double().flatten()
    return [float(t.sum()), float((t * torch.arange(1, t.numel() + 1, dtype=torch.float64)).sum())]


def tie_report(pm, name: str) -> dict:
    """For each of the two tied names this rank holds: its fingerprint; `same_object`: both names
    are one Parameter here (None when this rank holds one end only: a pipeline stage)."""
    state = pm.state_dict_for_checkpoint()
    names = TIES[name]
    prints = {n: fingerprint(state[n]) for n in names if n in state}
    held = [n for n in names if n in _all_names(pm)]
    same = _param(pm, held[0]) is _param(pm, held[1]) if len(held) == 2 else None
    return {"prints": prints, "same_object": same}


def _all_names(pm) -> list[str]:
    from dtorch.parallel.materialize import clean_name

    return [clean_name(n) for part in pm.model_parts for n, _ in part.named_parameters(remove_duplicate=False)]


def _param(pm, name: str):
    from dtorch.parallel.materialize import clean_name

    for part in pm.model_parts:
        for n, p in part.named_parameters(remove_duplicate=False):
            if clean_name(n) == name:
                return p
    raise KeyError(name)


def train(name: str, plan: Plan, rank: int, seed: int = 0):
    """5 AdamW steps of `name` under `plan`: (ParallelModel, per-step losses)."""
    from dtorch.parallel.parallelize import parallelize

    pm = parallelize(partial(factory, name), plan, loss_fn=next_token, seed=seed, seq_len=SEQ)
    opt = torch.optim.AdamW(list(pm.parameters()), lr=LR, foreach=False)
    local = pm.local_batch
    rows = slice(pm.dp_rank * local, (pm.dp_rank + 1) * local)
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = batch(step, plan.dp * plan.local_batch())
        losses.append(float(pm.forward_backward(x[rows], y[rows])))
        if step == 0:  # the tied weight's gradient, by every name this rank holds
            grads = {n: _full(_param(pm, n).grad).tolist() for n in TIES[name] if n in _all_names(pm)}
        opt.step()
        opt.zero_grad()
    return pm, losses, grads


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def worker(case: tuple[str, dict], rank: int) -> dict:
    """case: (key, {"model", "plan": Plan fields, "ckpt": directory, "load_from": a checkpoint
    directory or absent}). Without load_from: trains, reports the losses, the tied gradient and
    the tie, saves a DCP checkpoint to ckpt/key, builds the model afresh (another seed) under the
    same plan, loads that checkpoint and reports the tie again. With load_from: only the fresh model
    loading `load_from` (a checkpoint of another plan: resharded by DCP)."""
    import torch.distributed.checkpoint as dcp

    from dtorch.parallel.parallelize import parallelize

    key, spec = case
    plan = Plan(**spec["plan"])
    out: dict = {}
    src = spec.get("load_from")
    if src is None:
        pm, out["losses"], out["grads"] = train(spec["model"], plan, rank)
        out["trained"] = tie_report(pm, spec["model"])
        src = os.path.join(spec["ckpt"], key)
        dcp.save(pm.state_dict_for_checkpoint(), checkpoint_id=src)
        del pm
    fresh = parallelize(partial(factory, spec["model"]), plan, loss_fn=next_token, seed=1, seq_len=SEQ)
    dcp.load(fresh.state_dict_for_checkpoint(), checkpoint_id=src)
    out["loaded"] = tie_report(fresh, spec["model"])
    return out
