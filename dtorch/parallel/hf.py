"""Hugging Face `transformers` causal LMs seen in the reference models' shape.

`adapt(model)` returns a thin module that holds the SAME submodules of a `LlamaForCausalLM`-style
model (Llama, Mistral, Qwen2, ... : `model.embed_tokens`, `model.layers`, `model.norm`,
`model.rotary_emb`, `lm_head`) or a `GPT2LMHeadModel` under torchtitan's names
(`tok_embeddings`, `pos_embeddings`, `layers` as an nn.ModuleDict, `norm`, `output`), with a
forward that takes token ids and returns logits. The executor then needs no hand-written plan:
blocks are found by name, TP roles come from HF's projection names (q_proj ... down_proj), and a
pipeline split deletes blocks without renumbering. Parameter names are the adapter's. Initial
weights: those of the model constructed on CPU after `torch.manual_seed(seed)` (materialize.py).

GPT-2's attention uses one fused `c_attn` Conv1D for q, k and v, so column-wise sharding would not
be head-aligned: tensor parallelism raises a ConfigError naming it (FSDP, DDP and PP work). Tied
input/output embeddings cannot be split across pipeline stages (ConfigError).
"""

from __future__ import annotations

import torch
from torch import nn

from dtorch.errors import ConfigError
from dtorch.parallel.structure import ANNOTATION_HELP


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
    input_modules = ("tok_embeddings", "pos_embeddings", "drop")

    def __init__(self, hf: nn.Module):
        super().__init__(hf)
        t = hf.transformer
        self.tok_embeddings, self.pos_embeddings, self.drop = t.wte, t.wpe, t.drop
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(t.h)})
        self.norm = t.ln_f
        self.output = hf.lm_head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.drop(self.tok_embeddings(tokens) + self.pos_embeddings(pos))
        else:
            h = tokens
        for layer in self.layers.values():
            out = layer(h)
            h = out[0] if isinstance(out, tuple) else out
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


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
