"""Where a model keeps its repeated blocks, embeddings and output head: found once, here.

The profiler (what one block costs, times the number of blocks), the executor (FSDP, TP, AC and
the pipeline split work block by block) and the monitor (the straggler watch and the live page
time every block's forward) all ask this module, so that they never disagree about which modules
the blocks are. The executor never edits model code; it finds the pieces:

1. an annotation on the model: `model._dtorch_blocks = "path.to.blocks"` (an nn.ModuleList or
   nn.ModuleDict);
2. otherwise a non-empty container under a usual name (`BLOCK_CONTAINERS`: DTorch's and
   torchtitan's `layers`, Hugging Face's `model.layers` or `transformer.h`, `h`, `blocks`);
3. otherwise the nn.ModuleList / nn.ModuleDict with the most structurally identical children
   (ties: the most parameters per child).

`uniform` says whether the blocks are structurally identical: the executor shards block by block
either way, the profiler (which measures one block and multiplies) refuses blocks that differ.

A model with none gets a ConfigError that shows the annotation that fixes it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from dtorch.errors import ConfigError

BLOCKS_ATTR = "_dtorch_blocks"
BLOCK_CONTAINERS = ("layers", "model.layers", "transformer.h", "h", "blocks")
ANNOTATION_HELP = (
    'tell DTorch where the repeated blocks are: `model._dtorch_blocks = "path.to.blocks"` (an nn.ModuleList '
    "or nn.ModuleDict), and for tensor parallelism annotate linear layers with "
    '`dtorch.parallel.annotate(module, "colwise"|"rowwise"|"embedding"|"output")`'
)

Container = nn.ModuleList | nn.ModuleDict


@dataclass(frozen=True)
class ModelStructure:
    """The pieces of a model, by module path (relative to the model)."""

    block_path: str
    """The container of the repeated blocks, e.g. "layers", "model.layers"."""
    block_names: tuple[str, ...]
    """The blocks' names in the container ("0", "1", ...), in order."""
    uniform: bool
    """Whether all blocks are structurally identical (same modules, same parameter shapes)."""
    embeddings: tuple[str, ...] = ()
    """nn.Embedding modules outside the blocks."""
    head: str | None = None
    """The nn.Linear to the vocabulary outside the blocks (None when the head reuses the embedding)."""

    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    def blocks(self, part: nn.Module) -> list[nn.Module]:
        """The blocks `part` holds: the whole model, a pipeline stage of it (fewer blocks), or either
        wrapped by DistributedDataParallel. [] when the part has no block container."""
        container = get_submodule(unwrap(part), self.block_path)
        return [m for _, m in block_items(container)] if isinstance(container, (nn.ModuleList, nn.ModuleDict)) else []


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel (or similar `.module`) wrapper."""
    inner = getattr(module, "module", None)
    return inner if isinstance(inner, nn.Module) and type(module).__name__ == "DistributedDataParallel" else module


def get_submodule(model: nn.Module, path: str) -> nn.Module | None:
    mod: nn.Module | None = model
    for part in path.split("."):
        mod = getattr(mod, part, None) if mod is not None else None
        if not isinstance(mod, nn.Module):
            return None
    return mod


def block_items(container: Container) -> list[tuple[str, nn.Module]]:
    return list(container.items()) if isinstance(container, nn.ModuleDict) else [
        (str(i), m) for i, m in enumerate(container)
    ]


def _signature(module: nn.Module) -> tuple:
    mods = tuple((n, type(m).__name__) for n, m in module.named_modules())
    params = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    return mods + params


def _uniform(container: Container) -> bool:
    return len({_signature(c) for c in container.children()}) == 1


def find_blocks(model: nn.Module) -> tuple[str, Container]:
    """(path, container) of the model's repeated blocks, by the rule in the module docstring."""
    model = unwrap(model)
    annotated = getattr(model, BLOCKS_ATTR, None)
    if annotated is not None:
        mod = get_submodule(model, annotated)
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and len(mod) > 0:
            return annotated, mod
        raise ConfigError(BLOCKS_ATTR, annotated, f"it names no non-empty nn.ModuleList/ModuleDict; {ANNOTATION_HELP}")
    for path in BLOCK_CONTAINERS:
        mod = get_submodule(model, path)
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and len(mod) > 0:
            return path, mod
    best: tuple[int, int, str, Container] | None = None
    for path, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.ModuleDict)) or len(mod) == 0 or not _uniform(mod):
            continue
        children = list(mod.children())
        size = sum(p.numel() for p in children[0].parameters())
        key = (len(children), size, path, mod)
        if size > 0 and (best is None or key[:2] > best[:2]):
            best = key
    if best is not None:
        return best[2], best[3]
    raise ConfigError("model", type(model).__name__, f"no repeated blocks found; {ANNOTATION_HELP}")


def find_structure(model: nn.Module) -> ModelStructure:
    """The model's blocks, embeddings and output head (meta tensors are fine)."""
    model = unwrap(model)
    path, container = find_blocks(model)
    inside = path + "."
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding) and not n.startswith(inside)]
    vocab = max((m.num_embeddings for _, m in embeddings), default=0)
    heads = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and not n.startswith(inside) and vocab and m.out_features == vocab]
    return ModelStructure(block_path=path, block_names=tuple(n for n, _ in block_items(container)),
                          uniform=_uniform(container), embeddings=tuple(n for n, _ in embeddings),
                          head=heads[-1] if heads else None)


def blocks_of(parts: Iterable[nn.Module], structure: ModelStructure | None = None) -> list[nn.Module]:
    """Every block of the given model parts (this rank's pipeline stages, maybe DDP-wrapped), by the
    structure the executor found (or found here on the first part). Raises ConfigError when a part
    holds no block: a watcher must not silently watch nothing."""
    parts = list(parts)
    if not parts:
        return []
    structure = structure or find_structure(parts[0])
    out: list[nn.Module] = []
    for part in parts:
        found = structure.blocks(part)
        if not found:
            raise ConfigError("model", type(unwrap(part)).__name__,
                              f"no blocks under '{structure.block_path}' in this model part; {ANNOTATION_HELP}")
        out += found
    return out
