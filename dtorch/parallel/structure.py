"""Where a model keeps its repeated blocks, embeddings, final norm and output head.

The executor never edits model code; it finds the pieces by name. DTorch reference models use
torchtitan's names (`tok_embeddings`, `layers`, `norm`, `output`); Hugging Face models keep them
under `model.` (Llama) or `transformer.` (GPT-2). A model with other names gets a ConfigError that
shows the annotation that fixes it: set `model._dtorch_blocks = "path.to.blocks"`.
"""

from __future__ import annotations

from torch import nn

from dtorch.errors import ConfigError

BLOCK_CONTAINERS = ("layers", "model.layers", "transformer.h", "h", "blocks")
ANNOTATION_HELP = (
    'tell DTorch where the repeated blocks are: `model._dtorch_blocks = "path.to.blocks"` (an nn.ModuleList '
    "or nn.ModuleDict), and for tensor parallelism annotate linear layers with "
    '`dtorch.parallel.annotate(module, "colwise"|"rowwise"|"embedding"|"output")`'
)


def get_submodule(model: nn.Module, path: str) -> nn.Module | None:
    mod: nn.Module | None = model
    for part in path.split("."):
        mod = getattr(mod, part, None) if mod is not None else None
        if not isinstance(mod, nn.Module):
            return None
    return mod


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleDict | nn.ModuleList]:
    """Return (path, container) of the model's repeated blocks."""
    paths = (getattr(model, "_dtorch_blocks", None),) + BLOCK_CONTAINERS
    for path in paths:
        if path is None:
            continue
        mod = get_submodule(model, path)
        if isinstance(mod, (nn.ModuleDict, nn.ModuleList)) and len(mod) > 0:
            return path, mod
    raise ConfigError("model", type(model).__name__, f"no block container found; {ANNOTATION_HELP}")


def block_items(container: nn.ModuleDict | nn.ModuleList) -> list[tuple[str, nn.Module]]:
    return list(container.items()) if isinstance(container, nn.ModuleDict) else [
        (str(i), m) for i, m in enumerate(container)
    ]
