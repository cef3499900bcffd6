"""Where a model keeps its repeated blocks, embeddings and output head: found once, here.

The profiler (what one block costs, times the number of blocks), the executor (FSDP, TP, AC and
the pipeline split work block by block) and the monitor (the straggler watch and the live page
time every block's forward) all ask this module, so that they never disagree about which modules
the blocks are. The executor never edits model code; it finds the pieces:

1. an annotation on the model: `model._dtorch_blocks = "path.to.blocks"` (an nn.ModuleList,
   nn.ModuleDict or nn.Sequential);
2. otherwise a non-empty container under a usual name (`BLOCK_CONTAINERS`: DTorch's and
   torchtitan's `layers`, Hugging Face's `model.layers` or `transformer.h`, `h`, `blocks`);
3. otherwise, at any depth, the longest run of same-class children holding parameters: all the
   children of an nn.ModuleList / nn.ModuleDict of one class, or the longest run of consecutive
   same-class children of an nn.Sequential (a CNN's stages, a ViT's `encoder.layers`); ties go to
   the most parameters per child. A Sequential's run needs two children at least.
4. none of these (a 3-layer MLP): the model has no repeated blocks, and the whole model is the one
   unit: no `block_names`, DDP/FSDP treat it as one unit, activation checkpointing and
   per-block compilation have nothing to wrap, and pipeline parallelism cannot apply.

In an nn.Sequential, the blocks are the run (`block_items`); the children before and after it
stay where they are. `uniform` says whether the blocks are structurally identical: the executor
shards block by block either way, the profiler measures one block of identical blocks and every
block otherwise. `before` / `after` name the parameter-holding modules registered before and after
the blocks, `tied` the parameters that share one tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from dtorch.errors import ConfigError

BLOCKS_ATTR = "_dtorch_blocks"
BLOCK_CONTAINERS = ("layers", "model.layers", "transformer.h", "h", "blocks")
ROLE_HELP = ('annotate it with `dtorch.parallel.annotate(module, "colwise"|"rowwise"|"replicate")` (and the '
             'embedding and head with "embedding"|"output"), or use tp=1 (FSDP, DDP and PP work)')
"""The fix for a linear layer without a tensor-parallel role."""
ANNOTATION_HELP = (
    'tell DTorch where the repeated blocks are: `model._dtorch_blocks = "path.to.blocks"` (an nn.ModuleList '
    "or nn.ModuleDict), and for tensor parallelism annotate linear layers with "
    '`dtorch.parallel.annotate(module, "colwise"|"rowwise"|"embedding"|"output")`'
)

Container = nn.ModuleList | nn.ModuleDict | nn.Sequential
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


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
    before: tuple[str, ...] = ()
    """Parameter-holding modules outside the blocks registered before them (stem, embeddings)."""
    after: tuple[str, ...] = ()
    """Parameter-holding modules outside the blocks registered after them (final norm, head)."""
    tied: tuple[tuple[str, ...], ...] = ()
    """Groups of parameter names that share one tensor (tied embeddings)."""

    @property
    def has_blocks(self) -> bool:
        """False when the model has no repeated blocks: the whole model is the one unit."""
        return bool(self.block_names)

    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    def blocks(self, part: nn.Module) -> list[nn.Module]:
        """The blocks `part` holds: the whole model, a pipeline stage of it (fewer blocks), or either
        wrapped by DistributedDataParallel; the whole part when the model has no repeated blocks.
        [] when the part has no block container."""
        if not self.has_blocks:
            return [unwrap(part)]
        container = get_submodule(unwrap(part), self.block_path)
        return [m for _, m in block_items(container)] if isinstance(container, _CONTAINERS) else []


def unwrap(module: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel (or similar `.module`) wrapper."""
    inner = getattr(module, "module", None)
    return inner if isinstance(inner, nn.Module) and type(module).__name__ == "DistributedDataParallel" else module


def get_submodule(model: nn.Module, path: str) -> nn.Module | None:
    """The module at dotted `path` ("" is the model itself), or None."""
    mod: nn.Module | None = model
    for part in path.split(".") if path else ():
        mod = getattr(mod, part, None) if mod is not None else None
        if not isinstance(mod, nn.Module):
            return None
    return mod


def join(path: str, name: str) -> str:
    """`path.name`, or `name` at the model's root (path "")."""
    return f"{path}.{name}" if path else name


def block_items(container: Container) -> list[tuple[str, nn.Module]]:
    """(name, block) of the blocks in `container`: every child of a ModuleList / ModuleDict, the
    longest run of same-class children of a Sequential (rule 3 of the module docstring)."""
    if isinstance(container, nn.ModuleDict):
        return list(container.items())
    if isinstance(container, nn.Sequential):
        return _longest_run(container)
    return [(str(i), m) for i, m in enumerate(container)]


def _longest_run(seq: nn.Sequential) -> list[tuple[str, nn.Module]]:
    """The longest run of consecutive same-class children with parameters (ties: the first; more
    parameters per child win over an equally long run)."""
    best: list[tuple[str, nn.Module]] = []
    run: list[tuple[str, nn.Module]] = []
    for name, child in seq.named_children():
        if run and type(child) is type(run[0][1]) and _has_params(child):
            run.append((name, child))
        else:
            run = [(name, child)] if _has_params(child) else []
        if (len(run), _size(run)) > (len(best), _size(best)):
            best = list(run)
    return best


def _has_params(m: nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def _size(run: list[tuple[str, nn.Module]]) -> int:
    return sum(p.numel() for p in run[0][1].parameters()) if run else 0


def _signature(module: nn.Module) -> tuple:
    mods = tuple((n, type(m).__name__) for n, m in module.named_modules())
    params = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    return mods + params


def _uniform(container: Container) -> bool:
    return len({_signature(m) for _, m in block_items(container)}) <= 1


def find_blocks(model: nn.Module) -> tuple[str, Container]:
    """(path, container) of the model's repeated blocks, by the rules in the module docstring; the
    blocks are `block_items(container)`. A model without repeated blocks gives ("", an empty
    nn.ModuleList): nothing to apply per block, the whole model is one unit."""
    model = unwrap(model)
    annotated = getattr(model, BLOCKS_ATTR, None)
    if annotated is not None:
        mod = get_submodule(model, annotated)
        if isinstance(mod, _CONTAINERS) and block_items(mod):
            return annotated, mod
        raise ConfigError(BLOCKS_ATTR, annotated,
                          f"it names no non-empty nn.ModuleList/ModuleDict/Sequential; {ANNOTATION_HELP}")
    for path in BLOCK_CONTAINERS:
        mod = get_submodule(model, path)
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and len(mod) > 0:
            return path, mod
    best: tuple[int, int, str, Container] | None = None
    for path, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
            if len(mod) == 0 or len({type(c) for c in mod.children()}) != 1:
                continue
            run = block_items(mod)
        elif isinstance(mod, nn.Sequential):
            run = block_items(mod)
            if len(run) < 2:
                continue
        else:
            continue
        key = (len(run), _size(run), path, mod)
        if key[1] > 0 and (best is None or key[:2] > best[:2]):
            best = key
    if best is not None:
        return best[2], best[3]
    return "", nn.ModuleList()


def find_structure(model: nn.Module) -> ModelStructure:
    """The model's blocks, embeddings, output head, the modules before and after the blocks, and its
    tied parameters (meta tensors are fine)."""
    model = unwrap(model)
    path, container = find_blocks(model)
    items = block_items(container)
    block_paths = tuple(join(path, n) for n, _ in items)

    def inside(name: str) -> bool:
        return any(name == b or name.startswith(b + ".") for b in block_paths)

    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding) and not inside(n)]
    vocab = max((m.num_embeddings for _, m in embeddings), default=0)
    heads = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and not inside(n) and vocab and m.out_features == vocab]
    before: list[str] = []
    after: list[str] = []
    seen_blocks = False
    for n, m in model.named_modules():
        if inside(n):
            seen_blocks = True
        elif next(m.parameters(recurse=False), None) is not None:
            (after if seen_blocks else before).append(n)
    by_tensor: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(n)
    tied = tuple(tuple(names) for names in by_tensor.values() if len(names) > 1)
    return ModelStructure(block_path=path, block_names=tuple(n for n, _ in items),
                          uniform=_uniform(container), embeddings=tuple(n for n, _ in embeddings),
                          head=heads[-1] if heads else None, before=tuple(before), after=tuple(after),
                          tied=tied)


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


CONTEXT_POSITIONS_HOOK = "token_positions"
"""Model attribute context parallelism installs (dtorch.parallel.cp): the global positions of the
local tokens."""
CONTEXT_ATTENTION_HOOK = "core_attention"
"""Attention-module attribute context parallelism installs: attention over the whole sequence."""


def context_hooks_reason(model: nn.Module) -> str:
    """Why context parallelism cannot be installed in `model` ('' when it can): the model must declare
    the two hooks the executor fills (DTorch's Llama and GPT do). One rule for the profiler, and so
    the planner, and for the executor's `check_cp`."""
    model = unwrap(model)
    if CONTEXT_POSITIONS_HOOK in dir(type(model)) and any(
            CONTEXT_ATTENTION_HOOK in dir(type(m)) for m in model.modules()):
        return ""
    return (f"context parallelism needs a model that declares the `{CONTEXT_POSITIONS_HOOK}` and "
            f"`{CONTEXT_ATTENTION_HOOK}` hooks (DTorch's Llama and GPT do; {type(model).__name__} does not)")


def may_leave_parameters_unused(model: nn.Module, inputs: tuple) -> bool:
    """Whether a training step of `model` on inputs like `inputs` may leave a parameter without a
    gradient (data parallelism must then reduce what each rank used): one forward on the meta device
    with `inputs` (a tuple of tensors) says no only when every parameter-holding module ran and the
    forward never needed a tensor's value (a branch on values, `if x.mean() > 0`, cannot run on
    meta). Any failure of that forward answers yes: the safe side."""
    import copy

    import torch

    model = unwrap(model)
    meta = model if all(t.is_meta for t in model.parameters()) else copy.deepcopy(model).to("meta")
    holders = {m for m in meta.modules() if any(True for _ in m.parameters(recurse=False))}
    ran: set[nn.Module] = set()
    handles = [m.register_forward_pre_hook(lambda mod, args: ran.add(mod)) for m in holders]
    try:
        with torch.no_grad():
            meta(*(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs))
    except Exception:  # noqa: BLE001 - a value-dependent branch (or anything meta cannot run)
        return True
    finally:
        for h in handles:
            h.remove()
    return not holders <= ran
