"""Hugging Face `transformers` causal LMs seen in the reference models' shape.

`adapt(model)` returns a thin module that holds the submodules of a `LlamaForCausalLM`-style
model (Llama, Mistral, Qwen2, ... : `model.embed_tokens`, `model.layers`, `model.norm`,
`model.rotary_emb`, `lm_head`) or a `GPT2LMHeadModel` under torchtitan's names
(`tok_embeddings`, `pos_embeddings`, `layers` as an nn.ModuleDict, `norm`, `output`), with a
forward that takes token ids and returns logits. The executor then needs no hand-written plan:
blocks are found by name, TP roles come from the projection names (q_proj ... down_proj), norms
whose name contains "norm" run on sequence shards under SP, and a pipeline split deletes blocks
without renumbering. Parameter names are the adapter's. Initial weights: those of the model
constructed on CPU after `torch.manual_seed(seed)` (materialize.py).

GPT-2 keeps q, k and v in one fused `c_attn` Conv1D (x @ W + b, W stored [in, out]), whose
column split would not be head-aligned. Its adapter therefore rebuilds each block with the same
LayerNorm, dropout and activation modules and with nn.Linear projections holding COPIES of the
Conv1D numbers (q/k/v split out of `c_attn`, weights transposed, biases kept): `q_proj`, `k_proj`,
`v_proj`, `o_proj`, `up_proj`, `down_proj`; the norms are `attention_norm` and `ffn_norm`. Logits
equal the original model's to float32 rounding; the caller's model is not modified, and training
the adapter does not update its Conv1D weights. Attention is causal scaled dot-product attention
with GPT2Attention's scaling (1/sqrt(head_dim), and 1/(layer+1) with
scale_attn_by_inverse_layer_idx); reorder_and_upcast_attn (an fp16 stability option of the eager
kernel) is not reproduced, and no attention mask or KV cache is taken. Tied input/output
embeddings stay tied (the same module); `apply_tp` keeps them tied as one vocabulary-sharded
Parameter, but `parallelize` still rejects tied embeddings under PP and, for now, TP (ConfigError).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtorch.errors import ConfigError
from dtorch.model.structure import ANNOTATION_HELP


def is_transformers_model(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers.")


class _HFAdapter(nn.Module):
    input_modules: tuple[str, ...] = ("tok_embeddings",)
    output_modules: tuple[str, ...] = ("norm", "output")

    def __init__(self, hf: nn.Module):
        super().__init__()
        object.__setattr__(self, "_hf", hf)  # not a submodule: its parameters are ours by new names
        self.config = hf.config

    def tied(self) -> bool:
        out, emb = getattr(self, "output", None), getattr(self, "tok_embeddings", None)
        return out is not None and emb is not None and out.weight is emb.weight


class HFDecoder(_HFAdapter):
    """LlamaForCausalLM and its relatives (RoPE given to every layer as position_embeddings)."""

    def __init__(self, hf: nn.Module):
        super().__init__(hf)
        self.tok_embeddings = hf.model.embed_tokens
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(hf.model.layers)})
        self.norm = hf.model.norm
        self.output = hf.lm_head
        self.rotary_emb = hf.model.rotary_emb

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        pos = torch.arange(h.shape[1], device=h.device)[None]
        rope = self.rotary_emb(h, pos)
        for layer in self.layers.values():
            h = layer(h, position_ids=pos, position_embeddings=rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


class HFGPT2(_HFAdapter):
    """GPT2LMHeadModel: its embeddings, final norm and head, and its blocks rebuilt as `_GPT2Block`."""

    input_modules = ("tok_embeddings", "pos_embeddings", "drop")

    def __init__(self, hf: nn.Module):
        super().__init__(hf)
        t = hf.transformer
        self.tok_embeddings, self.pos_embeddings, self.drop = t.wte, t.wpe, t.drop
        self.layers = nn.ModuleDict({str(i): _GPT2Block(layer, i) for i, layer in enumerate(t.h)})
        self.norm = t.ln_f
        self.output = hf.lm_head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.drop(self.tok_embeddings(tokens) + self.pos_embeddings(pos))
        else:
            h = tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


class _GPT2Attention(nn.Module):
    """GPT-2 causal self-attention with q, k, v and the output projection as separate nn.Linear
    layers (the same numbers as the fused `c_attn` / `c_proj` Conv1D). The number of heads is read
    from the q projection's output size, so a column-wise sharded q/k/v runs this rank's heads."""

    def __init__(self, hf_attn: nn.Module, layer_idx: int):
        super().__init__()
        dim = hf_attn.embed_dim
        self.head_dim = hf_attn.head_dim
        # GPT2Attention's two config switches; 1.0 is "no scaling"
        self.scaling = self.head_dim**-0.5 if hf_attn.scale_attn_weights else 1.0
        if hf_attn.scale_attn_by_inverse_layer_idx:
            self.scaling /= float(layer_idx + 1)
        self.q_proj, self.k_proj, self.v_proj = (_linear_from_conv1d(hf_attn.c_attn, i * dim, (i + 1) * dim)
                                                 for i in range(3))
        self.o_proj = _linear_from_conv1d(hf_attn.c_proj)
        self.attn_dropout = hf_attn.attn_dropout
        self.resid_dropout = hf_attn.resid_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        heads = (*q.shape[:-1], q.shape[-1] // self.head_dim, self.head_dim)  # local heads under TP
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scaling,
            dropout_p=self.attn_dropout.p if self.training else 0.0,
        )
        b, _, s, _ = out.shape
        out = out.transpose(1, 2).reshape(b, s, -1)
        return self.resid_dropout(self.o_proj(out))


class _GPT2MLP(nn.Module):
    def __init__(self, hf_mlp: nn.Module):
        super().__init__()
        self.up_proj = _linear_from_conv1d(hf_mlp.c_fc)
        self.act = hf_mlp.act  # "gelu_new" (tanh approximation) by default
        self.down_proj = _linear_from_conv1d(hf_mlp.c_proj)
        self.dropout = hf_mlp.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(self.act(self.up_proj(x))))


class _GPT2Block(nn.Module):
    """A `GPT2Block` (pre-norm self-attention and MLP with residuals) under torchtitan's names:
    its LayerNorms are `attention_norm` / `ffn_norm` (run on sequence shards under SP)."""

    def __init__(self, hf_block: nn.Module, layer_idx: int):
        super().__init__()
        self.attention_norm = hf_block.ln_1
        self.attn = _GPT2Attention(hf_block.attn, layer_idx)
        self.ffn_norm = hf_block.ln_2
        self.mlp = _GPT2MLP(hf_block.mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attention_norm(x))
        return h + self.mlp(self.ffn_norm(h))


def _linear_from_conv1d(conv: nn.Module, lo: int = 0, hi: int | None = None) -> nn.Linear:
    """An nn.Linear computing output features [lo, hi) of a transformers Conv1D (y = x @ W + b, W
    stored [in, out]): weight W[:, lo:hi] transposed, bias b[lo:hi], copied (on meta: free). Built
    on meta and then assigned, so that no initialiser draws from torch's RNG."""
    w, b = conv.weight, conv.bias
    hi = w.shape[1] if hi is None else hi
    lin = nn.Linear(w.shape[0], hi - lo, bias=b is not None, device="meta")
    with torch.no_grad():
        lin.weight = nn.Parameter(w[:, lo:hi].t().clone(memory_format=torch.contiguous_format),
                                  requires_grad=w.requires_grad)
        if b is not None:
            lin.bias = nn.Parameter(b[lo:hi].clone(), requires_grad=b.requires_grad)
    return lin


def adapt(model: nn.Module) -> nn.Module:
    """The reference-shaped view of a transformers causal LM; other models are returned as they are."""
    if not is_transformers_model(model):
        return model
    if type(model).__name__ == "GPT2LMHeadModel":
        return HFGPT2(model)
    inner = getattr(model, "model", None)
    if all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) and hasattr(model, "lm_head"):
        return HFDecoder(model)
    raise ConfigError("model", type(model).__name__, f"this transformers architecture is not mapped; {ANNOTATION_HELP}")
