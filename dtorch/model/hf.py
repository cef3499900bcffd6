"""Hugging Face `transformers` causal LMs seen in the reference models' shape (the executor's and the
profiler's one view of them; dtorch.parallel.hf re-exports it).

`adapt(model)` returns a thin module holding the submodules of any `AutoModelForCausalLM` whose
backbone runs embedding -> decoder layers -> final norm (Llama, Mistral, Mixtral, Qwen2/3,
Qwen3-MoE, Gemma 2/3, Phi-3, GPT-NeoX, OLMo 2, ...: `HFCausalLM`), or a `GPT2LMHeadModel`
(`HFGPT2`), under torchtitan's names (`tok_embeddings`, `layers` as an nn.ModuleDict, `norm`,
`output`), with a forward that takes token ids and returns the model's own logits: every decoder
layer gets the attention mask transformers itself builds for its layer type (causal, or sliding
window where the config has one: eager attention has no causal default), its rotary position
embeddings and position ids. The executor then needs no hand-written plan: blocks are found by
name, TP roles come from the layer names (dtorch.model.tp_rules), norms whose name contains
"norm" run on sequence shards under SP, and a pipeline split deletes blocks without renumbering
(each stage builds its masks from its input's length). Parameter names are the adapter's
(`layers.0.self_attn.q_proj.weight`). Initial weights: those of the model constructed on CPU after
`torch.manual_seed(seed)` (materialize.py). No padding mask, KV cache or packed sequences: one
window of tokens per row, as DTorch's data gives them.

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

import inspect

import torch
import torch.nn.functional as F
from torch import nn


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


class HFCausalLM(_HFAdapter):
    """Any transformers causal LM whose backbone runs embedding -> decoder layers -> final norm, with
    the layers called as the backbone calls them: hidden states first, then `attention_mask` (built
    by transformers' own `create_causal_mask` / `create_sliding_window_causal_mask` per layer type,
    so eager attention is causal and sliding windows are honoured), `position_embeddings` (the
    backbone's rotary module, per layer type where it takes one) and `position_ids`.

    Model-specific steps the backbone's forward does around the layers are reproduced from the
    config: the embedding dropout (GPT-NeoX) and the final logit soft-capping (Gemma 2/3); Gemma's
    sqrt(hidden) embedding scale is inside its embedding module.
    A backbone holding any other module with parameters (learned position embeddings, ...) is
    refused by `adapt`, naming it."""

    input_modules = ("tok_embeddings", "drop")

    def __init__(self, hf: nn.Module, base: nn.Module, layers: nn.ModuleList, norm: nn.Module):
        super().__init__(hf)
        self.tok_embeddings = hf.get_input_embeddings()
        self.drop = next((m for n, m in base.named_children() if n in _DROPOUTS), None)
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})
        self.norm = norm
        self.output = hf.get_output_embeddings()
        self.rotary_emb = getattr(base, "rotary_emb", None)
        cfg = self.config
        n = len(layers)
        window = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None)
        # Mistral, Mixtral, Phi-3 have no layer_types: one mask kind for all layers, as their forward
        self.layer_types = list(types[:n]) if types else ["sliding_attention" if window else "full_attention"] * n
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        rope = self.rotary_emb
        self._rope_per_type = rope is not None and "layer_type" in inspect.signature(rope.forward).parameters

    def _masks(self, h: torch.Tensor) -> dict[str, torch.Tensor | None]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        # no position_ids: they are 0..s-1 (no packed sequences to detect, a data-dependent check that
        # meta and fake tensors cannot run)
        args = dict(config=self.config, inputs_embeds=h, attention_mask=None, cache=None)
        return {kind: make[kind](**args) for kind in set(self.layer_types)}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.drop is not None:
                h = self.drop(h)
        else:
            h = tokens
        pos = torch.arange(h.shape[1], device=h.device)[None]
        masks = self._masks(h)
        rope: dict[str, object] = {}
        if self._rope_per_type:
            rope = {kind: self.rotary_emb(h, pos, kind) for kind in set(self.layer_types)}
        elif self.rotary_emb is not None:
            rope = dict.fromkeys(set(self.layer_types), self.rotary_emb(h, pos))
        for name, layer in self.layers.items():
            kind = self.layer_types[int(name)]
            h = layer(h, attention_mask=masks[kind], position_embeddings=rope.get(kind), position_ids=pos)
            if isinstance(h, tuple):
                h = h[0]
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        logits = self.output(h)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


HFDecoder = HFCausalLM  # the former name
_DROPOUTS = ("drop", "emb_dropout", "embed_dropout", "embedding_dropout")
_FINAL_NORMS = ("norm", "final_layer_norm", "final_layernorm", "ln_f")
_BLOCKS = ("layers", "h", "blocks")


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
    """The reference-shaped view of a transformers causal LM whose backbone the adapters understand
    (`HFCausalLM`, `HFGPT2`); every other model, a transformers one included (BLOOM's embedding
    LayerNorm and ALiBi, a model that is not a causal LM), is returned as it is written and runs its
    own forward, as any user's module does (blocks found by `find_blocks`, TP roles by
    `dtorch.model.tp_rules`, a pipeline cut by `dtorch.model.split`). A transformers model run as
    written keeps no KV cache (`config.use_cache` off, as transformers does under gradient
    checkpointing): a block re-run by activation checkpointing would append its keys again."""
    if not is_transformers_model(model):
        return model
    if type(model).__name__ == "GPT2LMHeadModel":
        return HFGPT2(model)
    written = _as_written(model)
    if written is not None:
        return written
    base = model.base_model
    children = dict(base.named_children())
    layers = next(children[n] for n in _BLOCKS if isinstance(children.get(n), nn.ModuleList))
    norm = next(children[n] for n in _FINAL_NORMS if n in children)
    return HFCausalLM(model, base, layers, norm)


def _as_written(model: nn.Module) -> nn.Module | None:
    """`model` itself, without a KV cache, when the generic adapter does not understand it; None
    when it does."""
    base = getattr(model, "base_model", None)
    children = dict(base.named_children()) if base is not None and base is not model else {}
    layers = next((children[n] for n in _BLOCKS if isinstance(children.get(n), nn.ModuleList)), None)
    norm = next((children[n] for n in _FINAL_NORMS if n in children), None)
    adaptable = (layers is not None and norm is not None
                 and callable(getattr(model, "get_output_embeddings", None)))
    if adaptable:
        known = {id(layers), id(norm), id(model.get_input_embeddings()), id(getattr(base, "rotary_emb", None))}
        # a backbone module the generic adapter would not call (BLOOM's embedding norm)
        adaptable = not any(id(m) not in known and n not in _DROPOUTS and any(True for _ in m.parameters())
                            for n, m in children.items())
    if adaptable:
        return None
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False
    return model
