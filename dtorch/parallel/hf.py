"""The transformers adapter under its executor-side name; it lives in dtorch.model.hf (the profiler
needs the same view of the model as the executor)."""

from dtorch.model.hf import (  # noqa: F401 - re-exported
    HFGPT2,
    HFCausalLM,
    HFDecoder,
    adapt,
    is_transformers_model,
)
