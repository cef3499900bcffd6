"""Hugging Face checkpoints in and out of DTorch's reference models, one slice at a time.

A Hugging Face model directory (``config.json`` plus ``model.safetensors`` or sharded
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``) of a supported family
maps onto a DTorch reference model:

    family     transformers class      DTorch model
    llama      LlamaForCausalLM        Llama (Llama 3 RoPE scaling supported)
    mistral    MistralForCausalLM      Llama (sliding window: full causal attention, exact while
                                              the sequence is no longer than the window: a
                                              longer seq_len is refused, `check_window`)
    qwen2      Qwen2ForCausalLM        Llama with q/k/v biases
    gpt2       GPT2LMHeadModel         GPT

`ADAPTERS` is the one table of name mappings. Each DTorch tensor comes from one Hugging Face
tensor by a transform:

- ``copy``: the same tensor;
- ``rope``: q/k projections (and biases): Hugging Face stores the two halves of each head's
  rotary pairs apart ("rotate_half"), DTorch interleaves them (Meta's layout); rows are permuted
  within each head;
- ``conv``: GPT-2's Conv1D stores weights [in, out]; DTorch's nn.Linear [out, in] (transposed).
  The fused ``c_attn`` holds q, k and v side by side: `part` says which third.
- ``stack``: mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) store one tensor per expert
  (``...experts.{e}.w1.weight``); DTorch stacks them into [n_experts, ...] (dtorch.models.moe), and
  a rank under expert parallelism reads only its experts;
- ``rope_norm``: Qwen3's per-head q/k RMSNorm weight [head_dim], permuted like the rows of a head.

    mixtral    MixtralForCausalLM      MoETransformer (softmax top-k, renormalised)
    qwen2_moe  Qwen2MoeForCausalLM     MoETransformer with q/k/v biases and a gated shared expert
    qwen3_moe  Qwen3MoeForCausalLM     MoETransformer with per-head q/k norms
  (their Switch-style router loss is not DeepSeek's sequence-wise balance loss: aux_loss_coef = 0)

`HFWeights(dir)` is what `parallelize(..., weights=)` / `Trainer(init_from=)` take: `fill_(name,
param)` copies into a parameter (a DTensor or a tensor) the block this rank stores, reading from
the safetensors files with `safe_open(...).get_slice` only the rows and columns that block needs
(for a rope tensor: the whole heads it overlaps). No rank ever reads the full checkpoint.
Tied input/output embeddings (``tie_word_embeddings``: GPT-2 by default, small Llama 3.2 / Qwen2)
load tied (`tie_embeddings` of the reference model: one Parameter on every plan) and export tied: no
``lm_head.weight``, ``tie_word_embeddings: true``; a checkpoint whose head differs from its
embedding (a run that loaded the checkpoint untied) exports untied. (Mixture-of-experts families
load a tied head as an untied copy.) `export_hf_files` copies the tokenizer files and
generation_config.json of the source directory beside an export; `save_run_config` keeps them next
to a run's checkpoints.

`export_hf(checkpoint_dir, out, ...)` writes a DCP checkpoint as such a directory, streaming: it
reads from the DCP checkpoint only the tensors of one output shard file at a time. It is the exact
inverse of loading: each transform is undone (a stacked expert weight becomes one tensor per
expert again), and a MoE config is mapped back through `dtorch_config` and compared field by field
before anything is written, so a model its family cannot express is refused, not mis-exported.
`write_seed_checkpoint(model, out)` writes any module's weights under their own names once, for
start-up on the `weights=` path when its initialisation cannot be rank-local.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtorch.errors import ConfigError
from dtorch.models.configs import GPTConfig, LlamaConfig, ModelConfig, MoEConfig

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SEED_MARKER = "dtorch_seed.json"
DEFAULT_SHARD_BYTES = 2 * 10**9


@dataclass(frozen=True)
class Rule:
    dtorch: str
    """DTorch parameter name; ``{i}`` stands for a block number."""
    hf: str
    """Hugging Face tensor name."""
    kind: str = "copy"
    """copy | rope_q | rope_k | rope_norm | conv | stack (see the module docstring)."""
    part: tuple[int, int] = (0, 1)
    """(j, n): this tensor is the j-th of n equal pieces of the HF tensor's output dimension."""


_LLAMA = [
    Rule("tok_embeddings.weight", "model.embed_tokens.weight"),
    Rule("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    Rule("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight", "rope_q"),
    Rule("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight", "rope_k"),
    Rule("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    Rule("layers.{i}.attention.wq.bias", "model.layers.{i}.self_attn.q_proj.bias", "rope_q"),
    Rule("layers.{i}.attention.wk.bias", "model.layers.{i}.self_attn.k_proj.bias", "rope_k"),
    Rule("layers.{i}.attention.wv.bias", "model.layers.{i}.self_attn.v_proj.bias"),
    Rule("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    Rule("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    Rule("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    Rule("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    Rule("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    Rule("norm.weight", "model.norm.weight"),
    Rule("output.weight", "lm_head.weight"),
]
_GPT2 = [
    Rule("tok_embeddings.weight", "transformer.wte.weight"),
    Rule("pos_embeddings.weight", "transformer.wpe.weight"),
    Rule("layers.{i}.attention_norm.weight", "transformer.h.{i}.ln_1.weight"),
    Rule("layers.{i}.attention_norm.bias", "transformer.h.{i}.ln_1.bias"),
    *(Rule(f"layers.{{i}}.attention.w{x}.{p}", f"transformer.h.{{i}}.attn.c_attn.{p}", "conv", (j, 3))
      for j, x in enumerate("qkv") for p in ("weight", "bias")),
    Rule("layers.{i}.attention.wo.weight", "transformer.h.{i}.attn.c_proj.weight", "conv"),
    Rule("layers.{i}.attention.wo.bias", "transformer.h.{i}.attn.c_proj.bias", "conv"),
    Rule("layers.{i}.ffn_norm.weight", "transformer.h.{i}.ln_2.weight"),
    Rule("layers.{i}.ffn_norm.bias", "transformer.h.{i}.ln_2.bias"),
    Rule("layers.{i}.feed_forward.w1.weight", "transformer.h.{i}.mlp.c_fc.weight", "conv"),
    Rule("layers.{i}.feed_forward.w1.bias", "transformer.h.{i}.mlp.c_fc.bias", "conv"),
    Rule("layers.{i}.feed_forward.w2.weight", "transformer.h.{i}.mlp.c_proj.weight", "conv"),
    Rule("layers.{i}.feed_forward.w2.bias", "transformer.h.{i}.mlp.c_proj.bias", "conv"),
    Rule("norm.weight", "transformer.ln_f.weight"),
    Rule("norm.bias", "transformer.ln_f.bias"),
    Rule("output.weight", "lm_head.weight"),
]
_ATTENTION = [r for r in _LLAMA if ".feed_forward." not in r.dtorch]
_DENSE_MLP = [r for r in _LLAMA if ".feed_forward." in r.dtorch]  # Qwen-MoE's mlp_only_layers


def _experts(prefix: str, names: tuple[str, str, str]) -> list[Rule]:
    """Routed experts: DTorch's stacked [n_experts, ...] weight from one HF tensor per expert."""
    return [Rule(f"layers.{{i}}.feed_forward.experts.{w}", f"model.layers.{{i}}.{prefix}.experts.{{e}}.{n}.weight",
                 "stack") for w, n in zip(("w1", "w2", "w3"), names)]


_MIXTRAL = [*_ATTENTION, Rule("layers.{i}.feed_forward.router.weight", "model.layers.{i}.block_sparse_moe.gate.weight"),
            *_experts("block_sparse_moe", ("w1", "w2", "w3"))]
_QWEN_MOE = [*_ATTENTION, *_DENSE_MLP, Rule("layers.{i}.feed_forward.router.weight", "model.layers.{i}.mlp.gate.weight"),
             *_experts("mlp", ("gate_proj", "down_proj", "up_proj"))]
_QWEN3_MOE = [*_QWEN_MOE,
              Rule("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight", "rope_norm"),
              Rule("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight", "rope_norm")]
_QWEN2_MOE = [*_QWEN_MOE,
              *(Rule(f"layers.{{i}}.feed_forward.shared_expert.{w}.weight", f"model.layers.{{i}}.mlp.shared_expert.{n}.weight")
                for w, n in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))),
              Rule("layers.{i}.feed_forward.shared_expert_gate.weight", "model.layers.{i}.mlp.shared_expert_gate.weight")]
ADAPTERS: dict[str, list[Rule]] = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "gpt2": _GPT2,
                                   "mixtral": _MIXTRAL, "qwen2_moe": _QWEN2_MOE, "qwen3_moe": _QWEN3_MOE}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Per Hugging Face `model_type`: DTorch name <-> HF name, transform."""
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gpt2": "GPT2LMHeadModel", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
TIED_SOURCE = {"llama": "model.embed_tokens.weight", "mistral": "model.embed_tokens.weight",
               "qwen2": "model.embed_tokens.weight", "gpt2": "transformer.wte.weight",
               **{k: "model.embed_tokens.weight" for k in MOE_FAMILIES}}


def _compile(rules: list[Rule]) -> list[tuple[re.Pattern, Rule]]:
    return [(re.compile("^" + re.escape(r.dtorch).replace(r"\{i\}", r"(\d+)") + "$"), r) for r in rules]


def rule_for(family: str, name: str) -> tuple[Rule, str]:
    """(the rule, the HF name) of DTorch tensor `name`; ConfigError if the table has none."""
    for pattern, rule in _compile(ADAPTERS[family]):
        m = pattern.match(name)
        if m:
            return rule, rule.hf.replace("{i}", m.group(1)) if m.groups() else rule.hf
    raise ConfigError("init_from", name, f"no {family} checkpoint tensor maps to this parameter of the model")


# ---- config.json <-> DTorch config ---------------------------------------------------------------
def read_config(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError("init_from", str(directory),
                          "not a Hugging Face model directory (no config.json); pass the directory "
                          "save_pretrained wrote")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError("init_from", str(path), f"config.json is not valid JSON ({e})") from None


def model_type(hf: dict[str, Any]) -> str:
    kind = hf.get("model_type")
    if kind not in ADAPTERS:
        raise ConfigError("init_from", f"model_type={kind!r} (architectures={hf.get('architectures')})",
                          "unknown architecture; supported: " + ", ".join(ADAPTERS))
    return kind


def dtorch_config(hf: dict[str, Any], max_seq_len: int | None = None) -> ModelConfig:
    """The reference-model config of a Hugging Face config.json (raises ConfigError for a feature
    the reference models do not have)."""
    kind = model_type(hf)

    def refuse(key: str, fix: str) -> None:
        raise ConfigError("init_from", f"{kind} {key}={hf.get(key)!r}", fix)

    if kind == "gpt2":
        if hf.get("scale_attn_by_inverse_layer_idx"):
            refuse("scale_attn_by_inverse_layer_idx", "not supported by DTorch's GPT; use a checkpoint without it")
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            refuse("activation_function", "DTorch's GPT uses the tanh GeLU (gelu_new)")
        if hf.get("scale_attn_weights", True) is False:
            refuse("scale_attn_weights", "DTorch's GPT scales attention by 1/sqrt(head_dim)")
        return GPTConfig(dim=hf["n_embd"], n_layers=hf["n_layer"], n_heads=hf["n_head"],
                         vocab_size=hf["vocab_size"], max_seq_len=max_seq_len or hf["n_positions"],
                         ffn_hidden=hf.get("n_inner") or 4 * hf["n_embd"],
                         dropout=float(hf.get("resid_pdrop", 0.1)),
                         norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), tie_embeddings=hf_tied(hf, kind))
    if kind in MOE_FAMILIES:
        return _moe_config(hf, kind, refuse, max_seq_len)
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "DTorch's Llama uses SwiGLU with silu")
    if hf.get("mlp_bias"):
        refuse("mlp_bias", "DTorch's Llama has no MLP biases")
    if hf.get("attention_bias") and kind != "qwen2":
        refuse("attention_bias", "DTorch's Llama has no attention biases (only Qwen2's q/k/v biases)")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        refuse("head_dim", f"DTorch's Llama needs head_dim = hidden_size / num_attention_heads "
                           f"= {hf['hidden_size'] // heads}")
    rope = hf.get("rope_scaling") or None
    if rope is None and isinstance(hf.get("rope_parameters"), dict):  # transformers >= 5 spelling
        params = hf["rope_parameters"]
        rope = params if params.get("rope_type", "default") != "default" else None
    scaling = None
    if rope is not None:
        if rope.get("rope_type", rope.get("type")) != "llama3":
            raise ConfigError("init_from", f"rope_scaling={rope}", "only Llama 3 RoPE scaling (rope_type llama3) is supported")
        scaling = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                   int(rope["original_max_position_embeddings"]))
    theta = hf.get("rope_theta")
    if theta is None and isinstance(hf.get("rope_parameters"), dict):
        theta = hf["rope_parameters"].get("rope_theta")
    return LlamaConfig(dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
                       n_kv_heads=hf.get("num_key_value_heads") or heads, vocab_size=hf["vocab_size"],
                       ffn_hidden=hf["intermediate_size"],
                       max_seq_len=max_seq_len or hf.get("max_position_embeddings", 8192),
                       norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(theta if theta is not None else 10000.0),
                       qkv_bias=kind == "qwen2", rope_scaling=scaling, tie_embeddings=hf_tied(hf, kind))


def check_window(hf: dict[str, Any] | None, seq_len: int) -> None:
    """ConfigError when the checkpoint's attention has a sliding window shorter than `seq_len`:
    DTorch's Llama attends over the whole causal context, so training would silently differ from
    the model that is loaded and exported (a transformers factory models the window)."""
    if not hf or model_type(hf) not in ("mistral", "qwen2"):
        return
    window = hf.get("sliding_window")
    if hf.get("model_type") == "qwen2" and not hf.get("use_sliding_window"):
        return
    if window and seq_len > window:
        raise ConfigError("seq_len", seq_len, f"longer than this {hf.get('model_type')} checkpoint's sliding_window="
                          f"{window}, which DTorch's Llama does not model; use seq_len <= {window}, or pass the "
                          "model as a transformers factory (AutoModelForCausalLM), which applies the window")


def hf_tied(hf: dict[str, Any], kind: str) -> bool:
    """Hugging Face's tie_word_embeddings, with transformers' default when config.json omits it
    (True for GPT-2, False for the Llama family)."""
    return bool(hf.get("tie_word_embeddings", kind == "gpt2"))


def _rope_theta(hf: dict[str, Any], kind: str) -> float:
    rope = hf.get("rope_scaling") or None
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    if rope is None and params.get("rope_type", "default") != "default":
        rope = params
    if rope is not None:
        raise ConfigError("init_from", f"{kind} rope_scaling={rope}", "RoPE scaling of mixture-of-experts models is not "
                          "supported; use a checkpoint with default RoPE")
    theta = hf.get("rope_theta", params.get("rope_theta"))
    return float(theta if theta is not None else 10000.0)


def _moe_config(hf: dict[str, Any], kind: str, refuse, max_seq_len: int | None) -> MoEConfig:
    """Mixtral, Qwen2-MoE and Qwen3-MoE config.json -> MoEConfig (dtorch.models.moe)."""
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "DTorch's experts are SwiGLU with silu")
    if hf.get("router_jitter_noise"):
        refuse("router_jitter_noise", "DTorch's router adds no noise; use a config with router_jitter_noise=0")
    if kind == "mixtral" and hf.get("sliding_window"):
        refuse("sliding_window", "DTorch's MoE attends over the whole causal context; use sliding_window=null")
    if kind != "mixtral" and hf.get("use_sliding_window"):
        refuse("use_sliding_window", "DTorch's MoE attends over the whole causal context; use use_sliding_window=false")
    if kind == "qwen3_moe" and hf.get("attention_bias"):
        refuse("attention_bias", "DTorch's Qwen3-MoE attention has no biases")
    heads = hf["num_attention_heads"]
    common = dict(dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
                  n_kv_heads=hf.get("num_key_value_heads") or heads,
                  head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, vocab_size=hf["vocab_size"],
                  max_seq_len=max_seq_len or hf.get("max_position_embeddings", 4096),
                  norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(hf, kind),
                  top_k=hf["num_experts_per_tok"], score_func="softmax",
                  aux_loss_coef=0.0)  # HF's Switch-style router loss is not DeepSeek's sequence-wise one: off
    if kind == "mixtral":
        return MoEConfig(**common, n_experts=hf["num_local_experts"], expert_hidden=hf["intermediate_size"],
                         norm_topk_prob=True)
    if hf.get("decoder_sparse_step", 1) != 1:
        refuse("decoder_sparse_step", "DTorch's MoE puts experts in every block after the dense first ones; "
               "use decoder_sparse_step=1")
    dense = list(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        refuse("mlp_only_layers", "DTorch's MoE supports dense blocks only as the first layers ([0, 1, ..., d-1])")
    extra: dict[str, Any] = {}
    if kind == "qwen2_moe":
        shared, hidden = hf.get("shared_expert_intermediate_size") or 0, hf["moe_intermediate_size"]
        if shared % hidden:
            refuse("shared_expert_intermediate_size", f"DTorch's shared experts are n x moe_intermediate_size={hidden}")
        extra = dict(n_shared_experts=shared // hidden, shared_expert_gate=bool(shared),
                     qkv_bias=bool(hf.get("qkv_bias", True)))  # (older configs: always biased)
    else:
        extra = dict(qk_norm=True)
    # (the Hub's Qwen configs say num_experts; transformers >= 5 writes num_local_experts)
    return MoEConfig(**common, **extra, n_experts=hf.get("num_experts") or hf["num_local_experts"], expert_hidden=hf["moe_intermediate_size"],
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)), n_dense_layers=len(dense),
                     ffn_hidden=hf.get("intermediate_size") if dense else None)


def hf_config(config: ModelConfig, family: str | None = None, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for a DTorch config (`base`: the config.json it was loaded from, kept for the
    keys DTorch does not model, e.g. token ids)."""
    out = dict(base or {})
    for k in ("_name_or_path", "transformers_version", "auto_map"):
        out.pop(k, None)
    if isinstance(config, MoEConfig):
        return _moe_hf_config(config, family or moe_family(config), out)
    if isinstance(config, GPTConfig):
        family = "gpt2"
        out.update(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=config.dim, n_layer=config.n_layers,
                   n_head=config.n_heads, vocab_size=config.vocab_size, n_positions=config.max_seq_len,
                   n_inner=config.ffn_hidden, layer_norm_epsilon=config.norm_eps,
                   activation_function="gelu_new", resid_pdrop=config.dropout, embd_pdrop=config.dropout,
                   attn_pdrop=config.dropout)
        for k in ("bos_token_id", "eos_token_id"):  # GPT2Config's defaults are GPT-2's 50256: not a token
            if not isinstance(out.get(k), int) or out[k] >= config.vocab_size:  # of a smaller vocabulary
                out[k] = None
    else:
        family = family or ("qwen2" if config.qkv_bias else "llama")
        out.update(model_type=family, architectures=[ARCHITECTURES[family]], hidden_size=config.dim,
                   num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
                   num_key_value_heads=config.n_kv_heads, head_dim=config.head_dim,
                   intermediate_size=config.ffn_hidden, vocab_size=config.vocab_size,
                   max_position_embeddings=config.max_seq_len, rms_norm_eps=config.norm_eps,
                   rope_theta=config.rope_theta, hidden_act="silu")
        if family == "llama":
            out.update(attention_bias=False, mlp_bias=False)
        if config.rope_scaling is not None and "rope_scaling" not in (base or {}):
            f, lo, hi, orig = config.rope_scaling
            out["rope_scaling"] = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo,
                                   "high_freq_factor": hi, "original_max_position_embeddings": orig}
    out["tie_word_embeddings"] = config.tie_embeddings
    if _dtype_key(out) not in out:
        out["torch_dtype"] = "float32"
    return out


def _dtype_key(cfg: dict[str, Any]) -> str:
    """The key a config.json names its dtype with ("dtype" since transformers 5, else "torch_dtype")."""
    return "dtype" if "dtype" in cfg else "torch_dtype"


TRAINING_ONLY = ("aux_loss_coef", "bias_update_speed", "capacity_factor")
"""MoEConfig fields that shape training only, not the model a Hugging Face config describes:
the balance loss, the bias update's speed (the bias itself is checked by `export_hf`: Hugging
Face's Mixtral and Qwen-MoE route without one) and the capacity (their forward is dropless)."""


def moe_family(config: MoEConfig) -> str:
    """The Hugging Face family a MoEConfig exports as when none is given: Qwen3-MoE with per-head q/k
    norms, Qwen2-MoE with shared experts or q/k/v biases, else Mixtral."""
    if config.qk_norm:
        return "qwen3_moe"
    return "qwen2_moe" if config.n_shared_experts or config.qkv_bias else "mixtral"


def _moe_hf_config(c: MoEConfig, family: str, out: dict[str, Any]) -> dict[str, Any]:
    """config.json of a MoE model: the inverse of `_moe_config` (keys it does not read kept from the
    base config). Raises ConfigError naming the first field the family's config cannot express
    (the config is mapped back and compared field by field)."""
    if family not in MOE_FAMILIES:
        raise ConfigError("family", family, f"a mixture-of-experts model exports as one of {', '.join(MOE_FAMILIES)}")
    out.update(model_type=family, architectures=[ARCHITECTURES[family]], hidden_size=c.dim,
               num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
               vocab_size=c.vocab_size, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
               hidden_act="silu", num_experts_per_tok=c.top_k)
    if out.get("head_dim") is not None or c.head_dim != c.dim // c.n_heads:
        out["head_dim"] = c.head_dim
    if isinstance(out.get("rope_parameters"), dict):  # transformers >= 5 spelling
        out["rope_parameters"] = {**out["rope_parameters"], "rope_theta": c.rope_theta}
    else:
        out["rope_theta"] = c.rope_theta
    if family == "mixtral":
        out.update(intermediate_size=c.expert_hidden, num_local_experts=c.n_experts)
        out.setdefault("sliding_window", None)
    else:
        out["num_local_experts" if "num_local_experts" in out and "num_experts" not in out else "num_experts"] = \
            c.n_experts
        out.update(moe_intermediate_size=c.expert_hidden, norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1,
                   mlp_only_layers=list(range(c.n_dense_layers)))
        if c.n_dense_layers or "intermediate_size" not in out:
            out["intermediate_size"] = c.ffn_hidden
        out.setdefault("use_sliding_window", False)
        if family == "qwen2_moe":
            out.update(shared_expert_intermediate_size=c.n_shared_experts * c.expert_hidden, qkv_bias=c.qkv_bias)
    out["tie_word_embeddings"] = False  # DTorch's head is its own tensor
    if _dtype_key(out) not in out:
        out["torch_dtype"] = "float32"
    try:
        back = dtorch_config(out)
    except ConfigError as e:
        raise ConfigError("export", f"{family} config", f"the model does not map onto a Hugging Face {family} config "
                          f"({e})") from None
    for f in dataclasses.fields(MoEConfig):
        mine, theirs = getattr(c, f.name), getattr(back, f.name)
        if f.name not in TRAINING_ONLY and mine != theirs:
            raise ConfigError("export", f"{f.name}={mine!r}", f"a Hugging Face {family} config cannot express it "
                              f"(it would load back as {theirs!r}); export a model of that family's shape, or keep "
                              "DCP checkpoints")
    return out


# ---- reading safetensors headers (no torch) -------------------------------------------------------
_SAFE_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigError("init_from", str(path), "not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        try:
            head = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError("init_from", str(path), "not a safetensors file (bad header)") from None
    head.pop("__metadata__", None)
    return head


def weight_files(directory: str | os.PathLike) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it} of a model directory."""
    d = Path(directory)
    index = d / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {k: d / v for k, v in weight_map.items()}
    files = [d / SINGLE_NAME] if (d / SINGLE_NAME).is_file() else sorted(d.glob("*.safetensors"))
    if not files:
        raise ConfigError("init_from", str(d), "no model.safetensors or model.safetensors.index.json in it "
                          "(only safetensors checkpoints are read; re-save with save_pretrained)")
    out: dict[str, Path] = {}
    for f in files:
        out.update(dict.fromkeys(_header(f), f))
    return out


def tensor_shapes(directory: str | os.PathLike) -> dict[str, tuple[list[int], str]]:
    """{tensor name: (shape, safetensors dtype)} read from the file headers only."""
    out: dict[str, tuple[list[int], str]] = {}
    for f in sorted(set(weight_files(directory).values())):
        for k, v in _header(f).items():
            out[k] = (list(v["shape"]), v["dtype"])
    return out


def _hf_name(family: str, name: str, present: dict[str, Any]) -> tuple[Rule, str]:
    rule, hf = rule_for(family, name)
    if hf not in present and hf.startswith("transformer.") and hf.removeprefix("transformer.") in present:
        hf = hf.removeprefix("transformer.")  # GPT-2 checkpoints saved from GPT2Model have no prefix
    if hf not in present and rule.dtorch == "output.weight":
        hf = TIED_SOURCE[family]
        if hf not in present and hf.removeprefix("transformer.") in present:
            hf = hf.removeprefix("transformer.")
    return rule, hf


def expected_hf_shape(rule: Rule, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the HF tensor that DTorch tensor of `shape` comes from under `rule`."""
    if rule.kind == "conv":
        n = rule.part[1]
        return (shape[1], shape[0] * n) if len(shape) == 2 else (shape[0] * n,)
    return tuple(shape)


def check_shapes(directory: str | os.PathLike, model_shapes: dict[str, tuple[int, ...]], family: str) -> int:
    """ConfigError naming the first tensor whose checkpoint shape does not match the model (or is
    missing); returns the checkpoint's total bytes. Reads file headers only."""
    present = tensor_shapes(directory)
    for name, shape in model_shapes.items():
        rule, hf = _hf_name(family, name, present)
        if rule.kind == "stack":  # one HF tensor per expert
            for e in range(shape[0]):
                one = hf.replace("{e}", str(e))
                if one not in present or tuple(present[one][0]) != tuple(shape[1:]):
                    got = list(present[one][0]) if one in present else "missing"
                    raise ConfigError("init_from", f"{one}: {got}", f"the model's {name} needs {shape[0]} experts "
                                      f"of shape {list(shape[1:])}; the checkpoint does not match the model")
            continue
        if hf not in present:
            raise ConfigError("init_from", f"{directory}: no tensor {hf}",
                              f"the model's {name} needs it; is this a {family} checkpoint of this size?")
        want = expected_hf_shape(rule, tuple(shape))
        if tuple(present[hf][0]) != want:
            raise ConfigError("init_from", f"{hf} has shape {list(present[hf][0])}",
                              f"the model's {name} needs {list(want)}; the checkpoint does not match the model "
                              "(check config.json against the weights, or the model you passed)")
    return sum(math.prod(s) * _SAFE_DTYPES.get(dt, 4) for s, dt in present.values())


# ---- loading: slices into DTensors --------------------------------------------------------------
class HFWeights:
    """Weights of a Hugging Face model directory (or a DTorch seed checkpoint) for
    `parallelize(..., weights=)`: `fill_(name, param)` reads only this rank's block."""

    def __init__(self, directory: str | os.PathLike, family: str | None = None, config: ModelConfig | None = None):
        self.directory = Path(directory)
        self.seed = (self.directory / SEED_MARKER).is_file()
        if self.seed:
            self.family = "seed"
        else:
            hf = read_config(self.directory)
            self.family = family or model_type(hf)
            self.config = config or dtorch_config(hf)
        self.files = weight_files(self.directory)
        self.bytes_read = 0
        self._open: dict[Path, Any] = {}

    @property
    def head_dims(self) -> tuple[int, int, int]:
        c = self.config
        return c.n_heads, c.n_kv_heads, c.head_dim

    def _slice(self, hf: str):
        from safetensors import safe_open

        # A file stays memory-mapped while it is open, and the pages read count as this process's
        # resident memory: open it per tensor, so at most one tensor's slice is mapped at a time.
        handle = safe_open(str(self.files[hf]), framework="pt", device="cpu")
        self._open["current"] = handle  # dropped (unmapped) when the next tensor is read
        return handle.get_slice(hf)

    def close(self) -> None:
        self._open.clear()

    def check(self, model_shapes: dict[str, tuple[int, ...]]) -> int:
        if self.seed:
            present = tensor_shapes(self.directory)
            for name, shape in model_shapes.items():
                if name not in present:
                    raise ConfigError("init_from", f"{self.directory}: no tensor {name}", "the seed checkpoint "
                                      "was written for another model")
                if tuple(present[name][0]) != tuple(shape):
                    raise ConfigError("init_from", f"{name} has shape {present[name][0]}",
                                      f"the model needs {list(shape)}")
            return sum(math.prod(s) * _SAFE_DTYPES.get(dt, 4) for s, dt in present.values())
        return check_shapes(self.directory, model_shapes, self.family)

    def read(self, name: str, global_shape: tuple[int, ...], offset: tuple[int, ...], shape: tuple[int, ...]):
        """The block `offset`+`shape` of DTorch tensor `name` (whole shape `global_shape`)."""
        if self.seed:
            rule, hf = Rule(name, name), name
        else:
            rule, hf = _hf_name(self.family, name, self.files)
        box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        if rule.kind == "stack":  # experts offset[0] .. offset[0]+shape[0]-1, each its own HF tensor
            import torch

            parts = []
            for e in range(offset[0], offset[0] + shape[0]):
                one = hf.replace("{e}", str(e))
                if one not in self.files:
                    raise ConfigError("init_from", f"{self.directory}: no tensor {one}", f"the model's {name} needs it")
                parts.append(self._slice(one)[box[1:]])
            t = torch.stack(parts)
            self.bytes_read += t.numel() * t.element_size()
            return t
        if hf not in self.files:
            raise ConfigError("init_from", f"{self.directory}: no tensor {hf}", f"the model's {name} needs it")
        sl = self._slice(hf)
        if rule.kind == "copy":
            t = sl[box] if box else sl[:]
        elif rule.kind == "conv":
            j, n = rule.part
            hf_shape = sl.get_shape()
            width = hf_shape[-1] // n
            if len(shape) == 2:
                lo = j * width + offset[0]
                t = sl[offset[1]:offset[1] + shape[1], lo:lo + shape[0]].t()
            else:
                lo = j * width + offset[0]
                t = sl[lo:lo + shape[0]]
        elif rule.kind == "rope_norm":  # a per-head q/k norm weight [head_dim]: its rotary pairs interleaved
            hd = self.head_dims[2]
            t = hf_to_interleaved(sl[:], 1, hd)[box]
        else:  # rope_q / rope_k: read the whole heads the block overlaps, un-rotate-half them
            hd = self.head_dims[2]
            r0, r1 = offset[0], offset[0] + shape[0]
            h0, h1 = r0 // hd, -(-r1 // hd)
            t = sl[(slice(h0 * hd, h1 * hd), *box[1:])]
            t = hf_to_interleaved(t, h1 - h0, hd)[r0 - h0 * hd:r1 - h0 * hd]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def fill_(self, name: str, param) -> None:
        from dtorch.models.init import local_box

        local, shape, offset = local_box(param)
        if local.numel() == 0:
            return
        block = self.read(name, tuple(param.shape), offset, shape)
        local.copy_(block.reshape(local.shape))
        del block
        self.close()


def hf_to_interleaved(t, heads: int, head_dim: int):
    """Rows of q/k (per head: first halves, then second halves of the rotary pairs) to Meta's
    interleaved layout (pairs adjacent). Works on [heads*head_dim, ...] and 1-D biases."""
    rest = t.shape[1:]
    return t.reshape(heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(heads * head_dim, *rest)


def interleaved_to_hf(t, heads: int, head_dim: int):
    """Inverse of `hf_to_interleaved` (DTorch -> Hugging Face)."""
    rest = t.shape[1:]
    return t.reshape(heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(heads * head_dim, *rest)


def model_shapes(meta_model) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a (meta) module's parameters."""
    return {n: tuple(p.shape) for n, p in meta_model.named_parameters()}


def load_model_config(directory: str | os.PathLike, max_seq_len: int | None = None) -> tuple[str, ModelConfig]:
    """(family, DTorch config) of a Hugging Face directory, or ConfigError."""
    hf = read_config(directory)
    return model_type(hf), dtorch_config(hf, max_seq_len=max_seq_len)


# ---- out: a DCP checkpoint to a Hugging Face directory -------------------------------------------
RUN_CONFIG = "hf_config.json"
"""Written into a run's checkpoint directory when it started from a Hugging Face directory."""


SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
              "generation_config.json")
"""Files of a Hugging Face model directory that are not weights or config.json, and that an export
carries over: the tokenizer and the generation config."""
RUN_FILES = "hf_files"
"""Where `save_run_config` keeps the source directory's SIDE_FILES, next to the checkpoints."""


def export_hf_files(out: str | os.PathLike, sources: list[str | os.PathLike | None]) -> list[str]:
    """Copy SIDE_FILES into `out` from the first of `sources` (directories; None and missing ones
    skipped) that has any; returns the names copied."""
    import shutil

    for src in sources:
        if src is None or not Path(src).is_dir():
            continue
        names = [n for n in SIDE_FILES if (Path(src) / n).is_file()]
        if names:
            Path(out).mkdir(parents=True, exist_ok=True)
            for n in names:
                tmp = Path(out) / f".{n}.tmp-{os.getpid()}"
                shutil.copyfile(Path(src) / n, tmp)
                os.replace(tmp, Path(out) / n)
            return names
    return []


def save_run_config(checkpoint_dir: str | os.PathLike, hf: dict[str, Any],
                    source: str | os.PathLike | None = None) -> None:
    """Keep the config.json a run started from (`hf`) and the tokenizer and generation files of its
    `source` directory next to its checkpoints, for `dtorch ckpt export --hf`."""
    d = Path(checkpoint_dir)
    d.mkdir(parents=True, exist_ok=True)
    _atomic_json(d / RUN_CONFIG, hf)
    export_hf_files(d / RUN_FILES, [source])


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def hf_tensor_plan(family: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[tuple[Rule, str]]]:
    """{HF name: [(rule, DTorch name), ...] in part order} for DTorch tensors of `shapes`."""
    out: dict[str, list[tuple[Rule, str]]] = {}
    for name in shapes:
        rule, hf = rule_for(family, name)
        out.setdefault(hf, []).append((rule, name))
    for v in out.values():
        v.sort(key=lambda rn: rn[0].part[0])
    return out


def to_hf(rules: list[tuple[Rule, Any]], config: ModelConfig):
    """One HF tensor from the DTorch tensors of its rules (full tensors)."""
    import torch

    pieces = []
    for rule, t in rules:
        if rule.kind == "rope_q":
            t = interleaved_to_hf(t, config.n_heads, config.head_dim)
        elif rule.kind == "rope_k":
            t = interleaved_to_hf(t, config.n_kv_heads, config.head_dim)
        elif rule.kind == "rope_norm":  # a per-head q/k norm weight [head_dim]
            t = interleaved_to_hf(t, 1, config.head_dim)
        elif rule.kind == "conv" and t.dim() == 2:
            t = t.t()
        pieces.append(t)
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)).contiguous()


def export_hf(
    checkpoint_dir: str | os.PathLike,
    out: str | os.PathLike,
    config: ModelConfig,
    *,
    family: str | None = None,
    base_config: dict[str, Any] | None = None,
    key: str = "model",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: str | None = None,
) -> Path:
    """Write committed DCP step directory `checkpoint_dir` (entry `key`: the model's state dict)
    as a Hugging Face directory `out`: config.json, model-0000i-of-0000n.safetensors and
    model.safetensors.index.json. One output shard's tensors are read from the checkpoint at a
    time, so memory holds at most one shard (plus one tensor). `dtype`: cast (e.g. bfloat16)."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    if isinstance(config, GPTConfig):
        family = "gpt2"
    elif isinstance(config, MoEConfig):
        family = family or moe_family(config)
    else:
        family = family or ("qwen2" if config.qkv_bias else "llama")
    reader = FileSystemReader(str(checkpoint_dir))
    meta = reader.read_metadata().state_dict_metadata
    prefix = key + "."
    shapes = {k[len(prefix):]: tuple(v.size) for k, v in meta.items() if k.startswith(prefix) and hasattr(v, "size")}
    if not shapes:
        raise ConfigError("key", key, f"the checkpoint has no '{key}' entry with tensors")
    # tied out when the model was tied (its config, or the source's tie_word_embeddings) and the
    # checkpoint's head still equals its embedding; a head trained apart exports untied
    tied = getattr(config, "tie_embeddings", False) or (base_config is not None and hf_tied(base_config, family))
    if hasattr(config, "tie_embeddings") and config.tie_embeddings != (tied and _tied_in_checkpoint(reader, meta, prefix)):
        config = dataclasses.replace(config, tie_embeddings=not config.tie_embeddings)
    cfg = hf_config(config, family, base_config)  # first: a model the family cannot express fails before any write
    if isinstance(config, MoEConfig):
        _check_no_routing_bias(reader, meta, prefix, [n for n in shapes if n.endswith(".expert_bias")])
        shapes = {n: v for n, v in shapes.items() if not n.endswith((".expert_bias", ".expert_load"))}
    plan = hf_tensor_plan(family, {k: v for k, v in shapes.items()})
    if getattr(config, "tie_embeddings", False):
        plan.pop("lm_head.weight", None)  # transformers ties it to the embedding, as saved models omit it
    # one output tensor per entry: (HF name, its DTorch tensors' rules and names, the expert or None);
    # a stacked expert weight [n_experts, ...] becomes one HF tensor per expert
    entries: list[tuple[str, list[tuple[Rule, str]], int | None]] = []
    for hf, rules in plan.items():
        if rules[0][0].kind == "stack":
            entries += [(hf.replace("{e}", str(e)), rules, e) for e in range(shapes[rules[0][1]][0])]
        else:
            entries.append((hf, rules, None))
    cast = getattr(torch, dtype) if dtype else None

    def nbytes(entry) -> int:
        _, rules, e = entry
        n = sum(math.prod(shapes[name][1:] if e is not None else shapes[name]) for _, name in rules)
        return n * (cast.itemsize if cast else 4)

    groups: list[list] = [[]]
    size = 0
    for entry in entries:
        if groups[-1] and size + nbytes(entry) > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes(entry)
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        wanted = {prefix + n: torch.empty(shapes[n], dtype=meta[prefix + n].properties.dtype)
                  for _, rules, _ in group for _, n in rules}
        dcp_load(wanted, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        tensors = {}
        for hf, rules, e in group:
            t = to_hf([(rule, wanted[prefix + n] if e is None else wanted[prefix + n][e]) for rule, n in rules], config)
            tensors[hf] = t.to(cast) if cast else t
            weight_map[hf] = fname
            total += tensors[hf].numel() * tensors[hf].element_size()
        del wanted
        tmp = outdir / f".{fname}.tmp-{os.getpid()}"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, outdir / fname)
        del tensors
    _atomic_json(outdir / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    if dtype:
        cfg[_dtype_key(cfg)] = dtype
    _atomic_json(outdir / "config.json", cfg)
    return outdir


def _tied_in_checkpoint(reader, meta, prefix: str) -> bool:
    """The checkpoint's head equals its token embedding (or is absent): a tied model's."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    names = [prefix + "tok_embeddings.weight", prefix + "output.weight"]
    if names[1] not in meta:
        return True
    if names[0] not in meta:
        return False
    wanted = {n: torch.empty(tuple(meta[n].size), dtype=meta[n].properties.dtype) for n in names}
    dcp_load(wanted, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    return torch.equal(*wanted.values())


def _check_no_routing_bias(reader, meta, prefix: str, names: list[str]) -> None:
    """ConfigError if an auxiliary-loss-free routing bias (`MoE.expert_bias`) in the checkpoint is not
    zero: Hugging Face's Mixtral and Qwen-MoE select experts without one, so the export would route
    differently from the trained model."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    if not names:
        return
    wanted = {prefix + n: torch.empty(tuple(meta[prefix + n].size), dtype=meta[prefix + n].properties.dtype)
              for n in names}
    dcp_load(wanted, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    for n in names:
        b = wanted[prefix + n]
        if bool(b.ne(0).any()):
            raise ConfigError("export", f"{n} (max |bias| {float(b.abs().max()):.3g})",
                              "the model routes with an auxiliary-loss-free bias that Hugging Face's Mixtral and "
                              "Qwen-MoE do not have, so the export would choose other experts; train with "
                              "bias_update_speed=0 to export, or keep DCP checkpoints")


def write_seed_checkpoint(model, out: str | os.PathLike, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the weights and buffers of `model` (a real module, e.g. one built and initialised
    once on CPU) under their own names, for `HFWeights(out)` / `init_from=out`: each rank then
    reads only its slices. Use it for modules whose initialisation cannot be rank-local."""
    from safetensors.torch import save_file

    from dtorch.parallel.hf import adapt
    from dtorch.parallel.materialize import clean_name

    model = adapt(model)
    # every name of a tied parameter: a pipeline stage may hold (and read) its second name only
    items = [(clean_name(n), t) for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]]
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    groups: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for n, t in items:
        b = t.numel() * t.element_size()
        if groups[-1] and size + b > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((n, t))
        size += b
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: t.detach().contiguous().clone() for n, t in group}, str(outdir / fname))
        weight_map.update(dict.fromkeys((n for n, _ in group), fname))
    _atomic_json(outdir / INDEX_NAME, {"metadata": {}, "weight_map": weight_map})
    _atomic_json(outdir / SEED_MARKER, {"format": "dtorch seed checkpoint", "tensors": len(items)})
    return outdir


__all__ = ["ADAPTERS", "HFWeights", "Rule", "check_shapes", "dtorch_config", "export_hf", "export_hf_files",
           "hf_config", "load_model_config", "model_shapes", "read_config", "tensor_shapes",
           "write_seed_checkpoint"]
