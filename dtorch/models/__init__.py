"""Reference models (GPT-2, Llama-3 and mixture-of-experts style) in plain PyTorch, unaware of parallelism.

Importing this package does not import torch: configs, presets and spec parsing are torch-free
(`dtorch plan` reads shapes from them); `Llama`, `GPT` and `build_model` load torch on first use.

    build_model("llama3-8b")                                      # a preset
    build_model("llama-tiny:layers=2", max_seq_len=512)           # a preset with overrides
    build_model("gpt:layers=24,hidden=2304,heads=24,vocab=51200,seq=2048")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dtorch.models.configs import PRESETS, GPTConfig, LlamaConfig, ModelConfig, MoEConfig, model_config

if TYPE_CHECKING:
    from torch import nn

__all__ = ["PRESETS", "GPT", "GPTConfig", "Llama", "LlamaConfig", "ModelConfig", "MoEConfig", "MoETransformer",
           "build_model",
           "build_from_config", "model_config"]

_LAZY = {"Llama": "dtorch.models.llama", "GPT": "dtorch.models.gpt", "MoETransformer": "dtorch.models.moe"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dtorch.models' has no attribute {name!r}")


def build_from_config(config: ModelConfig) -> nn.Module:
    """The module for a config, built on the current default device (use `with torch.device("meta")`
    for a weightless skeleton, then `to_empty(device=...)` and `init_weights(seed)`)."""
    if isinstance(config, LlamaConfig):
        from dtorch.models.llama import Llama

        return Llama(config)
    if isinstance(config, MoEConfig):
        from dtorch.models.moe import MoETransformer

        return MoETransformer(config)
    assert isinstance(config, GPTConfig), type(config)
    from dtorch.models.gpt import GPT

    return GPT(config)


def build_model(spec: str, **overrides: Any) -> nn.Module:
    """Build a reference model from a spec (preset name, `<preset>:k=v,...`, `gpt:...`, `llama:...`);
    `overrides` are config fields or spec aliases (layers, hidden, heads, kv_heads, ffn, vocab, seq).
    Weights are initialised with seed 0; call `init_weights(seed)` for another seed.
    Raises ConfigError for an unknown preset or a malformed spec."""
    return build_from_config(model_config(spec, **overrides))
