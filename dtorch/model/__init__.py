"""What the model is, for the planner: `profile(spec, seq_len) -> ModelProfile`.

A spec is one of
- a reference-model spec (`llama3-8b`, `llama3-8b:layers=2`, `gpt:layers=..,hidden=..,heads=..`):
  profiled by formula (`dtorch.model.analytic`), instantly and without importing torch;
- a factory `pkg.module:function` returning an nn.Module: measured on meta/fake tensors
  (`dtorch.model.profiler`);
- a path to a Hugging Face `config.json` of any causal LM transformers knows (`AutoModelForCausalLM`:
  Llama, Mistral, Qwen, Gemma, Phi-3, GPT-2, GPT-NeoX, OLMo, ...): the model is built from the
  config on meta and measured (needs the optional extra `hf`: transformers).
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtorch.errors import ConfigError
from dtorch.model.analytic import profile_from_config
from dtorch.model.profile import ModelProfile
from dtorch.models.configs import FAMILIES, PRESETS, SPEC_FORMS, model_config

__all__ = ["ModelProfile", "profile", "profile_from_config", "profile_module"]

SPEC_HELP = (SPEC_FORMS + ", a factory 'pkg.module:function' returning an nn.Module, "
             "or a path to a Hugging Face config.json of a causal LM (AutoModelForCausalLM)")
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
HF_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")
"""How a causal LM's class name ends in a config's `architectures` (any model_type transformers maps
to AutoModelForCausalLM is accepted too)."""


def __getattr__(name: str) -> Any:
    if name == "profile_module":  # imports torch: only on demand
        from dtorch.model.profiler import profile_module

        return profile_module
    raise AttributeError(f"module 'dtorch.model' has no attribute {name!r}")


def profile(spec: str, seq_len: int, fused_attention: bool = False) -> ModelProfile:
    """The ModelProfile of `spec` (see the module docstring) at `seq_len` tokens per sequence.
    `fused_attention`: a measured model's attention as a GPU runs it (`profile_module`).

    Raises ConfigError naming the spec and the valid forms when it is none of them."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("model", spec, "use " + SPEC_HELP)
    spec = spec.strip()
    head = spec.partition(":")[0]
    if head in PRESETS or head in FAMILIES:
        return profile_from_config(model_config(spec), seq_len, name=spec)
    if is_hf_config(spec):
        return _profile_hf_config(Path(spec), seq_len, fused_attention)
    if _FACTORY.match(spec):
        return _profile_factory(spec, seq_len, fused_attention)
    raise ConfigError("model", spec, "unknown model; use " + SPEC_HELP)


def _profile_factory(spec: str, seq_len: int, fused_attention: bool = False) -> ModelProfile:
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        top = module_name.partition(".")[0]
        searched = any(p in ("", ".") or Path(p).resolve() == Path.cwd() for p in sys.path)
        if (Path(top + ".py").is_file() or Path(top, "__init__.py").is_file()) and not searched:
            # the console script does not search the current directory (as Python's own tools)
            raise ConfigError("model", spec, f"cannot import '{module_name}' ({e}): '{top}' is in the current "
                              f"directory, which the dtorch command does not search; run it as "
                              f"PYTHONPATH=. dtorch ...") from None
        raise ConfigError("model", spec, f"cannot import '{module_name}' ({e}); use " + SPEC_HELP) from None
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise ConfigError("model", spec, f"'{module_name}' has no callable '{func_name}'")
    from dtorch.model.profiler import profile_module

    return profile_module(factory, seq_len, name=spec, sample=_example_input(module, spec),
                          fused_attention=fused_attention)


def _example_input(module: Any, spec: str) -> tuple[Any, Any] | None:
    """The factory module's `example_input()`: (inputs, target) of one batch, or inputs alone (the
    profile then uses the mean of the output as its loss); None when the module defines none."""
    example = getattr(module, "example_input", None)
    if example is None:
        return None
    if not callable(example):
        raise ConfigError("example_input", spec, "must be a function returning (inputs, target) of one batch")
    try:
        value = example()
    except Exception as e:  # noqa: BLE001 - the user's code: one line, not a traceback
        raise ConfigError("example_input", spec, f"it raised {type(e).__name__}: {' '.join(str(e).split())[:200]}; "
                          "it must return (inputs, target) of one batch") from None
    return tuple(value) if isinstance(value, (tuple, list)) and len(value) == 2 else (value, None)


def hf_config_factory(spec: str) -> Callable[[], Any]:
    """A factory of the causal LM a Hugging Face `config.json` at `spec` describes (transformers'
    own initialisation), with SDPA attention where the model has a kernel for it (a training run's
    choice: eager attention would keep the s x s scores; Gemma 2 and BLOOM have none). ConfigError
    naming the file when it is not a readable config of a causal LM transformers knows."""
    path = Path(spec)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("model", str(path), "no such file; use " + SPEC_HELP) from None
    except (OSError, ValueError) as e:
        raise ConfigError("model", str(path), f"not a readable JSON config ({e})") from None
    archs = data.get("architectures") or []
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        raise ConfigError("model", str(path), "Hugging Face configs need transformers: "
                          "pip install 'dtorch-os[hf]'") from None
    kind = data.get("model_type")
    arch = next((a for a in archs if a.endswith(HF_ARCHITECTURES) and hasattr(transformers, a)), None)
    if arch is None and kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind]
    if arch is None:
        raise ConfigError("model", str(path), f"architectures={archs} model_type={kind!r}: not a causal language "
                          "model transformers knows (AutoModelForCausalLM); DTorch adapts any of those")
    config = transformers.AutoConfig.for_model(**{k: v for k, v in data.items() if k != "architectures"})
    model_cls = getattr(transformers, arch)
    config._attn_implementation = "sdpa" if getattr(model_cls, "_supports_sdpa", True) else "eager"
    return lambda: model_cls(config)


def is_hf_config(spec: str) -> bool:
    """Whether `spec` names a Hugging Face config file rather than a preset, family spec or factory."""
    head = spec.strip().partition(":")[0]
    return head not in PRESETS and head not in FAMILIES and (spec.endswith(".json") or Path(spec).is_file())


def model_factory_of(spec: str) -> Callable[[], Any]:
    """What `dtorch train --model spec` builds: a preset or family spec's reference model, or the
    transformers model of a Hugging Face config.json (`hf_config_factory`). ConfigError naming the
    spec when it is neither."""
    if is_hf_config(spec):
        return hf_config_factory(spec)
    model_config(spec)  # the one-line error for an unknown spec, before any worker
    from dtorch.models import build_model

    return lambda: build_model(spec)


def spec_vocab(spec: str) -> int:
    """The vocabulary size of `model_factory_of(spec)`'s model."""
    if is_hf_config(spec):
        hf_config_factory(spec)  # the same checks (readable, a causal LM)
        return int(json.loads(Path(spec).read_text())["vocab_size"])
    return model_config(spec).vocab_size


def _profile_hf_config(path: Path, seq_len: int, fused_attention: bool = False) -> ModelProfile:
    factory = hf_config_factory(str(path))
    from dtorch.model.profiler import profile_module

    return profile_module(factory, seq_len, name=str(path), fused_attention=fused_attention)
