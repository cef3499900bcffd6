"""A Llama-3 style decoder in plain PyTorch: RoPE, grouped-query attention, SwiGLU, RMSNorm.

The model knows nothing about parallelism. Its module names follow torchtitan so that one
tensor-parallel plan fits it and the GPT model alike:

    tok_embeddings, layers["0".."n-1"].{attention_norm, attention.{wq,wk,wv,wo},
    ffn_norm, feed_forward.{w1,w2,w3}}, norm, output

Pipeline stages are made from outside by setting `tok_embeddings` / `norm` / `output` to None and
deleting entries of `layers`; a stage without `tok_embeddings` takes hidden states [b, s, dim]
instead of tokens, a stage without `output` returns hidden states. Attention reads the number of
local heads from the projection outputs at run time, so column-wise sharded wq/wk/wv just work.
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
from dtorch.models.configs import LlamaConfig

__all__ = ["Llama", "LlamaConfig"]


def rope_tables(head_dim: int, max_seq_len: int, theta: float,
                scaling: tuple[float, float, float, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, [max_seq_len, head_dim/2] float32, computed in float64 on
    the CPU so that every device gets bit-identical tables. `scaling`: Llama 3.1's frequency
    scaling (factor, low_freq_factor, high_freq_factor, original context length): wavelengths
    longer than original/low are slowed by `factor`, shorter than original/high kept, and the
    band between interpolated smoothly."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        factor, low, high, original = (float(v) for v in scaling)
        wavelen = 2 * math.pi / inv_freq
        smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of x [b, s, heads, head_dim] by the position angle
    (Meta's interleaved layout). cos/sin: [s, head_dim/2]."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    core_attention = None
    """None: causal attention over the input sequence. Context parallelism (dtorch.parallel.cp)
    installs a callable (q, k, v, *, dropout_p, enable_gqa) -> output that attends to the keys of
    the whole sequence when the input holds only a slice of it."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.head_dim = config.head_dim
        bias = bool(getattr(config, "qkv_bias", False))
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=bias)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=bias)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=bias)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # view(..., -1, head_dim): the head count comes from the (possibly TP-sharded) outputs.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, s, head_dim]
        # Grouped-query attention: each kv head serves q_heads/kv_heads query heads. The kernel
        # broadcasts k/v itself, so only the small k/v are kept for backward (no repeat_interleave).
        gqa = q.shape[1] != k.shape[1]
        if self.core_attention is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            y = self.core_attention(q, k, v, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama-3 decoder. forward(tokens LongTensor[b, s]) -> logits float[b, s, vocab_size]."""

    input_modules = ("tok_embeddings",)
    """Modules a pipeline split keeps on the first stage only."""
    output_modules = ("norm", "output")
    """Modules a pipeline split keeps on the last stage only."""
    token_positions = None
    """None: the input holds positions 0..s-1. Context parallelism (dtorch.parallel.cp) installs a
    callable (s, device) -> (global positions LongTensor[s] of the input's tokens, global length)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:  # one Parameter; pipeline stages keep their copies equal (parallel/ties.py)
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: derived from the config, recomputed by init_buffers() after to_empty().
        self.register_buffer("rope_cos", torch.empty(config.max_seq_len, config.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_seq_len, config.head_dim // 2), persistent=False)
        self.init_weights()

    def init_buffers(self) -> None:
        """(Re)compute the RoPE tables on the buffers' current device (skipped on meta)."""
        if self.rope_cos.is_meta:
            return
        cos, sin = rope_tables(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta,
                               getattr(self.config, "rope_scaling", None))
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def init_weights(self, seed: int | None = None) -> None:
        """Deterministically (re)initialise every parameter and buffer; None means seed 0, so every
        rank agrees without talking. Weights N(0, 0.02); the residual projections wo and w2
        N(0, 0.02/sqrt(2*n_layers)) (GPT-2 scaling); norms 1. See dtorch.models.init."""
        seed = 0 if seed is None else seed
        std, resid_std = 0.02, 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("bias"):  # q/k/v biases (qkv_bias)
                init.constant_(param, 0.0)
            elif name.endswith("norm.weight"):
                init.constant_(param, 1.0)
            elif name.endswith(("wo.weight", "w2.weight")):
                init.normal_(param, resid_std, seed, name)
            else:
                init.normal_(param, std, seed, name)
        self.init_buffers()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return decoder_forward(self, tokens)


def decoder_forward(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The forward of a RoPE decoder laid out as Llama (also dtorch.models.moe.MoETransformer):
    embedding (absent on a later pipeline stage: `tokens` are then hidden states), the RoPE rows of
    the positions (`token_positions` under context parallelism), the blocks, norm and head (absent
    before the last stage)."""
    h = model.tok_embeddings(tokens) if model.tok_embeddings is not None else tokens
    s = h.shape[1]
    pos, seq_len = (None, s) if model.token_positions is None else model.token_positions(s, h.device)
    if seq_len > model.config.max_seq_len:
        raise ConfigError("seq_len", seq_len, f"at most max_seq_len={model.config.max_seq_len}; build the "
                          "model with a larger max_seq_len (spec key seq=)")
    if pos is None:
        cos, sin = model.rope_cos[:s], model.rope_sin[:s]
    else:
        cos, sin = model.rope_cos[pos], model.rope_sin[pos]
    for layer in model.layers.values():
        h = layer(h, cos, sin)
    h = model.norm(h) if model.norm is not None else h
    return model.output(h) if model.output is not None else h
