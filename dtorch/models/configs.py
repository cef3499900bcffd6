"""Hyper-parameters of the reference models, and the spec strings that name them. Torch-free.

This module must not import torch: `dtorch plan` reads model shapes from here and has to start
in well under a second. The modules themselves live in `gpt.py` and `llama.py`.

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
    """A Llama-3 style decoder: RoPE, grouped-query attention, SwiGLU, RMSNorm, untied head."""

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
    """A GPT-2 style decoder: learned positions, LayerNorm, GeLU MLP (4*dim), biases, untied head."""

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


ModelConfig = LlamaConfig | GPTConfig

# Published shapes. Llama 3.2 1B and GPT-2 tie the output head to the token embedding; our
# reference models never tie (the head and the embedding sit on different pipeline stages), so
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
PRESETS: dict[str, ModelConfig] = {**LLAMA_PRESETS, **GPT_PRESETS}

FAMILIES: dict[str, type] = {"llama": LlamaConfig, "gpt": GPTConfig}

ALIASES = {
    "layers": "n_layers",
    "hidden": "dim",
    "heads": "n_heads",
    "kv_heads": "n_kv_heads",
    "ffn": "ffn_hidden",
    "vocab": "vocab_size",
    "seq": "max_seq_len",
    "eps": "norm_eps",
}
SPEC_FORMS = (
    "a preset (" + ", ".join(PRESETS) + "), '<preset>:key=value,...', "
    "'gpt:layers=L,hidden=H,heads=A,vocab=V,seq=S' or "
    "'llama:layers=L,hidden=H,heads=A,kv_heads=K,ffn=F,vocab=V,seq=S'"
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
        if "dim" in values and "ffn_hidden" not in values:
            values["ffn_hidden"] = None  # derive the MLP width from the new dim, not the preset's
        return dataclasses.replace(base, **values)
    missing = [a for a in ("layers", "hidden", "heads") if ALIASES[a] not in values]
    if missing:
        raise ConfigError("model", spec, f"missing {', '.join(missing)}; use " + SPEC_FORMS)
    return cls(**values)


def _parse_value(spec: str, key: str, raw: str, annotation: Any) -> Any:
    want_float = "float" in str(annotation)
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
