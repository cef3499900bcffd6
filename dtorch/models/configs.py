"""Hyper-parameters of the reference models, and the spec strings that name them. Torch-free.

This module must not import torch: `dtorch plan` reads model shapes from here and has to start
in well under a second. The modules themselves live in `gpt.py`, `llama.py` and `moe.py`.

A model *spec* is one of:

- a preset name: ``llama3-8b``, ``gpt2-small``, ``llama-tiny`` ... (see `PRESETS`);
- a preset with overrides: ``llama3-8b:layers=2,seq=4096``;
- a family with explicit shapes: ``gpt:layers=24,hidden=2304,heads=24,vocab=51200,seq=2048`` or
  ``llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256,seq=8192``.

Keys accept the short aliases in `ALIASES` or the config field names themselves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dtorch.errors import ConfigError, choices


def _round_up(x: int, multiple: int) -> int:
    return multiple * ((x + multiple - 1) // multiple)


def _check_positive(cfg: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(name, value, "must be a positive integer")


@dataclass
class LlamaConfig:
    """A Llama-3 style decoder: RoPE, grouped-query attention, SwiGLU, RMSNorm, head untied by default."""

    dim: int = 4096
    """Model (hidden) width."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads; head_dim = dim / n_heads."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means n_heads (multi-head attention)."""
    vocab_size: int = 128256
    ffn_hidden: int | None = None
    """SwiGLU hidden width (w1/w3 out_features); None derives it like Llama: 8/3*dim rounded up to 256."""
    max_seq_len: int = 8192
    """Longest sequence the RoPE table covers."""
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2); Llama and Mistral have none."""
    rope_scaling: tuple[float, float, float, int] | None = None
    """Llama 3.1 RoPE frequency scaling (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings), as in Llama 3.1/3.2 checkpoints; None: plain RoPE."""
    tie_embeddings: bool = False
    """The output head shares the token embedding's weight (one Parameter): Hugging Face's
    tie_word_embeddings (GPT-2, Llama 3.2 1B/3B, small Qwen2)."""

    family = "llama"

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_hidden is None:
            self.ffn_hidden = _round_up(int(2 * 4 * self.dim / 3), 256)
        _check_positive(self, ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "max_seq_len"))
        if self.dim % self.n_heads:
            raise ConfigError("dim", self.dim, f"must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("n_kv_heads", self.n_kv_heads, f"must divide n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError("dim", self.dim, f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def preset(cls, name: str) -> LlamaConfig:
        """The published shape of a Llama preset (`LLAMA_PRESETS`), as a fresh config."""
        if name not in LLAMA_PRESETS:
            raise ConfigError("model", name, choices(LLAMA_PRESETS))
        return dataclasses.replace(LLAMA_PRESETS[name])


@dataclass
class GPTConfig:
    """A GPT-2 style decoder: learned positions, LayerNorm, GeLU MLP (4*dim), biases, head untied by default."""

    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    vocab_size: int = 50257
    max_seq_len: int = 1024
    """Number of learned position embeddings (the longest sequence)."""
    ffn_hidden: int | None = None
    """MLP hidden width; None means 4 * dim."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches."""
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    """The output head shares the token embedding's weight (one Parameter): Hugging Face's
    tie_word_embeddings (GPT-2, Llama 3.2 1B/3B, small Qwen2)."""

    family = "gpt"

    def __post_init__(self) -> None:
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.dim
        _check_positive(self, ("dim", "n_layers", "n_heads", "vocab_size", "ffn_hidden", "max_seq_len"))
        if self.dim % self.n_heads:
            raise ConfigError("dim", self.dim, f"must be a multiple of n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", self.dropout, "use a probability in [0, 1)")

    @property
    def n_kv_heads(self) -> int:
        """GPT-2 uses multi-head attention: as many key/value heads as query heads."""
        return self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def preset(cls, name: str) -> GPTConfig:
        """The published shape of a GPT-2 preset (`GPT_PRESETS`), as a fresh config."""
        if name not in GPT_PRESETS:
            raise ConfigError("model", name, choices(GPT_PRESETS))
        return dataclasses.replace(GPT_PRESETS[name])


@dataclass
class MoEConfig:
    """A mixture-of-experts decoder (DeepSeek-V3, Qwen3-MoE, Mixtral): Llama-style blocks whose
    SwiGLU is replaced by routed experts (+ optional shared experts), with GQA or DeepSeek's
    multi-head latent attention (MLA). The model is `dtorch.models.moe.MoETransformer`."""

    dim: int = 4096
    """Model (hidden) width."""
    n_layers: int = 32
    """Number of transformer blocks (dense + MoE)."""
    n_heads: int = 32
    """Query heads."""
    n_kv_heads: int | None = None
    """Key/value heads of GQA attention; None means n_heads. Unused by MLA."""
    head_dim: int | None = None
    """Per-head width of GQA attention; None means dim / n_heads (Qwen3 uses 128 with dim 2048)."""
    vocab_size: int = 32000
    max_seq_len: int = 4096
    """Longest sequence the RoPE table covers."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    n_experts: int = 8
    """Routed experts per MoE block."""
    top_k: int = 2
    """Routed experts each token is sent to."""
    expert_hidden: int = 14336
    """SwiGLU hidden width of one routed expert (moe_intermediate_size)."""
    n_shared_experts: int = 0
    """Shared experts every token goes through (DeepSeek); one SwiGLU of n_shared * expert_hidden."""
    n_dense_layers: int = 0
    """Leading blocks with a dense SwiGLU of ffn_hidden instead of experts (DeepSeek-V3: 3)."""
    ffn_hidden: int | None = None
    """Dense blocks' SwiGLU width; None means expert_hidden."""
    score_func: str = "softmax"
    """Router scores: 'softmax' (Mixtral, Qwen3) or 'sigmoid' (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k gate weights to sum to 1 (Mixtral, Qwen3-MoE, DeepSeek-V3)."""
    route_scale: float = 1.0
    """Multiplier of the gate weights (DeepSeek-V3's routed_scaling_factor 2.5)."""
    n_expert_groups: int = 1
    """Group-limited routing (DeepSeek-V3: 8 groups): experts split into groups ..."""
    topk_groups: int = 1
    """... and each token picks experts only from its `topk_groups` best groups (DeepSeek-V3: 4),
    a group ranked by the sum of its two best scores. 1 group: plain top-k."""
    aux_loss_coef: float = 0.0
    """Weight of the sequence-wise load-balancing loss (DeepSeek-V3's alpha = 1e-4; 0 disables).
    Per sequence: n_experts/(top_k*s) * sum_i count_i * mean_t p_i,t, averaged over sequences, so
    it is the same whether a batch is split over data-parallel ranks or not."""
    bias_update_speed: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3, gamma = 1e-3): a per-expert bias added to the
    scores for expert selection only, moved by this step after each optimizer step toward equal
    load (`MoETransformer.update_expert_bias`). 0 disables."""
    capacity_factor: float | None = None
    """None: dropless (every token reaches its top_k experts). A number c: each expert takes at
    most ceil(c * tokens * top_k / n_experts) assignments per forward, the later ones (in token
    order) are dropped: their gate contribution is zero and the token keeps its residual."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2-MoE)."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(a learned dim -> 1 projection) (Qwen2-MoE)."""
    attention: str = "gqa"
    """'gqa' (grouped-query attention, Llama-style) or 'mla' (DeepSeek multi-head latent attention)."""
    q_lora_rank: int = 0
    """MLA: rank of the query down-projection (0: queries projected directly from the input)."""
    kv_lora_rank: int = 512
    """MLA: width of the compressed key/value latent."""
    qk_nope_head_dim: int = 128
    """MLA: per-head query/key width without RoPE."""
    qk_rope_head_dim: int = 64
    """MLA: per-head query/key width that carries RoPE (the key part is shared by all heads)."""
    v_head_dim: int = 128
    """MLA: per-head value width."""

    family = "moe"

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.ffn_hidden is None:
            self.ffn_hidden = self.expert_hidden
        _check_positive(self, ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "max_seq_len",
                               "n_experts", "top_k", "expert_hidden", "ffn_hidden", "n_expert_groups", "topk_groups"))
        if self.n_heads % self.n_kv_heads:
            raise ConfigError("n_kv_heads", self.n_kv_heads, f"must divide n_heads={self.n_heads}")
        if self.attention not in ("gqa", "mla"):
            raise ConfigError("attention", self.attention, "use 'gqa' or 'mla'")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ConfigError("score_func", self.score_func, "use 'softmax' or 'sigmoid'")
        if self.rope_dim % 2:
            raise ConfigError("head_dim", self.rope_dim, "the RoPE width must be even")
        if self.attention == "mla" and self.v_head_dim > self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ConfigError("v_head_dim", self.v_head_dim, "at most qk_nope_head_dim + qk_rope_head_dim = "
                              f"{self.qk_nope_head_dim + self.qk_rope_head_dim} (values are padded to that width)")
        if self.top_k > self.n_experts:
            raise ConfigError("top_k", self.top_k, f"at most n_experts={self.n_experts}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError("n_dense_layers", self.n_dense_layers, f"use 0..n_layers={self.n_layers}")
        if self.n_shared_experts < 0:
            raise ConfigError("n_shared_experts", self.n_shared_experts, "must be >= 0")
        if self.n_experts % self.n_expert_groups:
            raise ConfigError("n_expert_groups", self.n_expert_groups, f"must divide n_experts={self.n_experts}")
        per_group = self.n_experts // self.n_expert_groups
        if self.topk_groups > self.n_expert_groups or (self.n_expert_groups > 1 and self.topk_groups * per_group
                                                        < self.top_k):
            raise ConfigError("topk_groups", self.topk_groups, f"use 1..{self.n_expert_groups} groups holding at "
                              f"least top_k={self.top_k} experts")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError("capacity_factor", self.capacity_factor, "use a positive number, or None for dropless")
        for name in ("aux_loss_coef", "bias_update_speed"):
            if getattr(self, name) < 0:
                raise ConfigError(name, getattr(self, name), "must be >= 0 (0 disables)")

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of each query/key head."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    @classmethod
    def preset(cls, name: str) -> MoEConfig:
        """The published shape of an MoE preset (`MOE_PRESETS`), as a fresh config."""
        if name not in MOE_PRESETS:
            raise ConfigError("model", name, choices(MOE_PRESETS))
        return dataclasses.replace(MOE_PRESETS[name])


ModelConfig = LlamaConfig | GPTConfig | MoEConfig

# Published shapes. Llama 3.2 1B and GPT-2 tie the output head to the token embedding; these
# presets do not (tie_embeddings=False; loading such a checkpoint ties), so
# their parameter counts are larger than the published ones (llama3-1b 1.50e9 vs 1.24e9,
# gpt2-small 163M vs 124M). The 8B/70B/405B counts match (8.03e9, 70.6e9, 405.9e9).
# RoPE scaling of Llama 3.1 long context is not modelled; max_seq_len defaults to 8192.
LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256,
                              ffn_hidden=192, max_seq_len=256, rope_theta=10000.0),
    "llama3-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192),
    "llama3-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336),
    "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672),
    "llama3-405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden=53248),
}
GPT_PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(dim=64, n_layers=4, n_heads=4, vocab_size=256, max_seq_len=256),
    "gpt2-small": GPTConfig(dim=768, n_layers=12, n_heads=12),
    "gpt2-medium": GPTConfig(dim=1024, n_layers=24, n_heads=16),
    "gpt2-large": GPTConfig(dim=1280, n_layers=36, n_heads=20),
    "gpt2-xl": GPTConfig(dim=1600, n_layers=48, n_heads=25),
}

# Published MoE shapes, from each model's config.json on the Hugging Face hub:
#   deepseek-v3   deepseek-ai/DeepSeek-V3 config.json (hidden 7168, 61 layers, first_k_dense_replace 3,
#                 intermediate 18432, moe_intermediate 2048, 256 routed + 1 shared, 8 per token,
#                 n_group 8 / topk_group 4, sigmoid scores, routed_scaling_factor 2.5, MLA q_lora 1536,
#                 kv_lora 512, qk_nope 128, qk_rope 64, v_head 128, vocab 129280); DeepSeek-V3 report
#                 (arXiv 2412.19437) for the balance loss alpha 1e-4 and bias speed gamma 1e-3.
#                 The multi-token-prediction module (14B of the 685B checkpoint) is not modelled.
#   qwen3-30b-a3b Qwen/Qwen3-30B-A3B config.json (hidden 2048, 48 layers, 32 q / 4 kv heads of 128,
#                 128 experts of 768, 8 per token, vocab 151936, untied, rope_theta 1e6, qk-norm).
#   mixtral-8x7b  mistralai/Mixtral-8x7B-v0.1 config.json (hidden 4096, 32 layers, 32 q / 8 kv heads,
#                 8 experts of 14336, 2 per token, vocab 32000, rope_theta 1e6).
# Long-context RoPE scaling (YaRN) is not modelled; max_seq_len is 4096 unless overridden.
MOE_PRESETS: dict[str, MoEConfig] = {
    "moe-tiny": MoEConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=256,
                          n_experts=8, top_k=2, expert_hidden=32, n_shared_experts=1, aux_loss_coef=0.01,
                          bias_update_speed=0.001),
    "mixtral-tiny": MoEConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=256,
                              n_experts=8, top_k=2, expert_hidden=64, aux_loss_coef=0.02),
    "deepseek-tiny": MoEConfig(dim=64, n_layers=3, n_heads=4, vocab_size=256, max_seq_len=256, n_experts=8,
                               top_k=2, expert_hidden=32, n_shared_experts=1, n_dense_layers=1, ffn_hidden=96,
                               score_func="sigmoid", route_scale=2.5, n_expert_groups=4, topk_groups=2,
                               aux_loss_coef=1e-4, bias_update_speed=1e-3, attention="mla", q_lora_rank=32,
                               kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    "deepseek-v3": MoEConfig(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, max_seq_len=4096,
                             norm_eps=1e-6, n_experts=256, top_k=8, expert_hidden=2048, n_shared_experts=1,
                             n_dense_layers=3, ffn_hidden=18432, score_func="sigmoid", route_scale=2.5,
                             n_expert_groups=8, topk_groups=4, aux_loss_coef=1e-4, bias_update_speed=1e-3,
                             attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128),
    "qwen3-30b-a3b": MoEConfig(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=151936,
                               max_seq_len=4096, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, n_experts=128,
                               top_k=8, expert_hidden=768, aux_loss_coef=1e-3),
    "mixtral-8x7b": MoEConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, max_seq_len=4096,
                              rope_theta=1e6, n_experts=8, top_k=2, expert_hidden=14336, aux_loss_coef=0.02),
}
PRESETS: dict[str, ModelConfig] = {**LLAMA_PRESETS, **GPT_PRESETS, **MOE_PRESETS}

FAMILIES: dict[str, type] = {"llama": LlamaConfig, "gpt": GPTConfig, "moe": MoEConfig}

ALIASES = {
    "layers": "n_layers",
    "hidden": "dim",
    "heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "ffn": "ffn_hidden",
    "vocab": "vocab_size",
    "seq": "max_seq_len",
    "eps": "norm_eps",
    "experts": "n_experts",
    "topk": "top_k",
    "expert_ffn": "expert_hidden",
    "shared": "n_shared_experts",
    "dense_layers": "n_dense_layers",
    "capacity": "capacity_factor",
}
SPEC_FORMS = (
    "a preset (" + ", ".join(PRESETS) + "), '<preset>:key=value,...', "
    "'gpt:layers=L,hidden=H,heads=A,vocab=V,seq=S' or "
    "'llama:layers=L,hidden=H,heads=A,kv_heads=K,ffn=F,vocab=V,seq=S' or "
    "'moe:layers=L,hidden=H,heads=A,experts=E,topk=K,expert_ffn=F,...'"
)


def model_config(spec: str, **overrides: Any) -> ModelConfig:
    """Parse a model spec (see the module docstring) into a fresh config; `overrides` win over the spec.

    Raises ConfigError naming the value and the valid forms for an unknown preset, an unknown key,
    a malformed ``key=value`` pair or a shape that does not fit (e.g. dim not a multiple of heads).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("model", spec, "use " + SPEC_FORMS)
    head, _, tail = spec.strip().partition(":")
    head = head.strip()
    if head in PRESETS:
        base: ModelConfig | None = PRESETS[head]
        cls: type = type(base)
    elif head in FAMILIES:
        base, cls = None, FAMILIES[head]
    else:
        raise ConfigError("model", spec, "unknown model; use " + SPEC_FORMS)
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in tail.split(","))):
        key, eq, raw = item.partition("=")
        key = ALIASES.get(key.strip(), key.strip())
        if not eq or not raw.strip():
            raise ConfigError("model", spec, f"'{item}' is not key=value; use " + SPEC_FORMS)
        if key not in fields:
            raise ConfigError("model", spec, f"unknown key '{item.partition('=')[0]}' for {cls.family}; "
                              + choices(sorted(set(ALIASES) | set(fields))))
        values[key] = _parse_value(spec, key, raw.strip(), fields[key])
    for key, val in overrides.items():
        key = ALIASES.get(key, key)
        if key not in fields:
            raise ConfigError(key, val, f"not a {cls.family} config field; " + choices(sorted(fields)))
        values[key] = val
    if base is not None:
        if "dim" in values and "ffn_hidden" not in values and cls is not MoEConfig:
            values["ffn_hidden"] = None  # derive the MLP width from the new dim, not the preset's
        return dataclasses.replace(base, **values)
    missing = [a for a in ("layers", "hidden", "heads") if ALIASES[a] not in values]
    if missing:
        raise ConfigError("model", spec, f"missing {', '.join(missing)}; use " + SPEC_FORMS)
    return cls(**values)


def _parse_value(spec: str, key: str, raw: str, annotation: Any) -> Any:
    want_float = "float" in str(annotation)
    if str(annotation) == "str":
        return raw
    if str(annotation) == "bool":
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ConfigError("model", spec, f"{key}={raw!r} must be true or false")
        return raw.lower() in ("true", "1")
    if "None" in str(annotation) and raw.lower() == "none":
        return None
    try:
        if want_float:
            return float(raw)
        value = float(raw)  # accept 128e3 or 2048.0 for integers, reject 2048.5
        if value != int(value):
            raise ValueError(raw)
        return int(value)
    except ValueError:
        kind = "a number" if want_float else "an integer"
        raise ConfigError("model", spec, f"{key}={raw!r} must be {kind}") from None
