"""A GPT-2 style decoder in plain PyTorch: learned positions, LayerNorm, GeLU MLP, dropout.

Same module names as the Llama model (torchtitan's), so one tensor-parallel plan fits both:

    tok_embeddings, pos_embeddings, layers["0".."n-1"].{attention_norm, attention.{wq,wk,wv,wo},
    ffn_norm, feed_forward.{w1 (up), w2 (down)}}, norm, output

Pipeline stages: set `tok_embeddings` and `pos_embeddings` (first stage only) / `norm` and
`output` (last stage only) to None and delete entries of `layers`. A stage without
`tok_embeddings` takes hidden states [b, s, dim] (positions were already added on the first
stage). Attention reads the number of local heads from the projection outputs at run time.
Two hooks, None unless an executor installs them, let the model run on a slice of each sequence
(context parallelism, dtorch.parallel.cp): the model's `token_positions` gives the global
positions of its input tokens, each attention module's `core_attention` replaces causal SDPA.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dtorch.errors import ConfigError
from dtorch.models import init
from dtorch.models.configs import GPTConfig

__all__ = ["GPT", "GPTConfig"]


def _dropout(p: float) -> nn.Module:
    # p == 0: no module at all, so nothing (not even a mask) is kept for backward.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class Attention(nn.Module):
    core_attention = None
    """None: causal attention over the input sequence. Context parallelism (dtorch.parallel.cp)
    installs a callable (q, k, v, *, dropout_p, enable_gqa) -> output that attends to the keys of
    the whole sequence when the input holds only a slice of it."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.wq = nn.Linear(config.dim, config.dim)
        self.wk = nn.Linear(config.dim, config.dim)
        self.wv = nn.Linear(config.dim, config.dim)
        self.wo = nn.Linear(config.dim, config.dim)
        self.resid_dropout = _dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # view(..., -1, head_dim): the head count comes from the (possibly TP-sharded) outputs.
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        if self.core_attention is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = self.core_attention(q, k, v, dropout_p=p)
        return self.resid_dropout(self.wo(y.transpose(1, 2).reshape(b, s, -1)))


class FeedForward(nn.Module):
    """w2(gelu(w1 x)), GPT-2's tanh-approximated GeLU."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim)
        self.dropout = _dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.gelu(self.w1(x), approximate="tanh")))


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class GPT(nn.Module):
    """GPT-2 decoder. forward(tokens LongTensor[b, s]) -> logits float[b, s, vocab_size]."""

    input_modules = ("tok_embeddings", "pos_embeddings")
    """Modules a pipeline split keeps on the first stage only."""
    output_modules = ("norm", "output")
    """Modules a pipeline split keeps on the last stage only."""
    token_positions = None
    """None: the input holds positions 0..s-1. Context parallelism (dtorch.parallel.cp) installs a
    callable (s, device) -> (global positions LongTensor[s] of the input's tokens, global length)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(config.max_seq_len, config.dim)
        self.emb_dropout = _dropout(config.dropout)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:  # one Parameter; pipeline stages keep their copies equal (parallel/ties.py)
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    def init_buffers(self) -> None:
        """GPT has no buffers; present so that every reference model has the same materialise path."""

    def init_weights(self, seed: int | None = None) -> None:
        """Deterministically (re)initialise every parameter; None means seed 0, so every rank agrees
        without talking. Weights N(0, 0.02), the residual projections wo and w2
        N(0, 0.02/sqrt(2*n_layers)) (GPT-2), biases 0, LayerNorm weights 1. See dtorch.models.init."""
        seed = 0 if seed is None else seed
        std, resid_std = 0.02, 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                init.constant_(param, 0.0)
            elif name.endswith("norm.weight"):
                init.constant_(param, 1.0)
            elif name.endswith(("wo.weight", "w2.weight")):
                init.normal_(param, resid_std, seed, name)
            else:
                init.normal_(param, std, seed, name)
        self.init_buffers()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            s = tokens.shape[1]
            pos, seq_len = (None, s) if self.token_positions is None else self.token_positions(s, tokens.device)
            if seq_len > self.config.max_seq_len:
                raise ConfigError("seq_len", seq_len, f"at most max_seq_len={self.config.max_seq_len}; build "
                                  "the model with a larger max_seq_len (spec key seq=)")
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                h = h + self.pos_embeddings(torch.arange(s, device=tokens.device) if pos is None else pos)
            h = self.emb_dropout(h)
        else:
            h = tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
