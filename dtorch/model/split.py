"""Can a model be cut into pipeline stages between its blocks, as it is written?

A pipeline stage of a model DTorch did not write runs the model's own forward
(`dtorch.parallel.pipeline`): the blocks of other stages are skipped, the stage's first block takes
the activation the previous stage sent, the stage stops at the first block it does not hold, and
the parameters outside the blocks live on the stage that uses them (the embedding on the first,
the head on the last). Other stages keep the parameter-free code around the blocks (positions,
masks, rotary tables), which recomputes the same values from the model's inputs; what the
parameters of another stage would have produced is zeros there and must reach nothing that counts.

`split_layout(model, inputs)` runs one forward on the meta device and checks exactly that from
the dataflow (every tensor is tagged with the parameters outside the blocks and the blocks it
depends on):

- each block's first input is the previous block's output, and its other inputs depend on no
  parameter (they are recomputed on every stage); a block returns a tensor or a tuple starting
  with it, whose other tensors nothing reads (a stage boundary carries one tensor);
- inside a block, nothing is read from outside but its arguments, its own parameters and values
  that depend on no parameter;
- after the last block, everything that depends on a parameter depends on the last block's
  output (the head reads the last block, not an earlier value);
- a parameter outside the blocks is used either before the first block or after the last,
  not both, and never inside a block; blocks share no parameter. One tensor registered under two
  names (a head tied to the embedding) may be used before the blocks under one name and after
  them under the other: the first stage holds the one, the last stage the other, and the executor
  keeps the two copies in sync (`dtorch.parallel.ties`).

The answer is a `SplitLayout` (which outside parameters the first / last stage holds) or the
first reason it cannot be split, one line naming the module.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dtorch.errors import ConfigError
from dtorch.model.hf import adapt, is_transformers_model
from dtorch.model.structure import block_items, find_blocks, get_submodule


@dataclass(frozen=True)
class SplitLayout:
    """Where a model's parameters outside the blocks go when it is cut between blocks."""

    block_path: str
    block_names: tuple[str, ...]
    first: tuple[str, ...] = ()
    """Parameters (names as `named_parameters` spells them) outside the blocks used before the first
    block: held by the first stage only."""
    last: tuple[str, ...] = ()
    """Used after the last block (or never): held by the last stage only."""
    called: tuple[str, ...] = field(default=())
    """Modules outside the blocks that the forward called (a module holding only parameters of
    another stage can be replaced whole there)."""
    block_output_arity: int = 0
    """How many elements a block's output tuple has (hidden first; the rest are non-tensors, or
    tensors nothing reads after the block returns, e.g. attention probabilities the model drops);
    0: a block returns a tensor."""


class _Unsplittable(Exception):
    pass


_aten = torch.ops.aten
_SHAPE_ONLY = frozenset(getattr(_aten, n).default for n in (
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "new_empty", "new_zeros",
    "new_ones", "new_full", "new_empty_strided") if hasattr(_aten, n))
"""Ops whose output does not depend on their input's values (only its shape, dtype and device): a
mask or position table built this way from the embedding's output is recomputed alike on every
stage, so it carries no dependence on the embedding's parameters."""


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Dataflow(TorchDispatchMode):
    """Tags every tensor the forward computes with the regions it depends on: -1 for a parameter
    outside the blocks (the head's own count as well), k for block k. Checks the rules of the
    module docstring op by op."""

    def __init__(self, outside: dict[int, list[str]], block_params: dict[int, int], names: list[str], path: str):
        super().__init__()
        self.outside, self.block_params, self.names, self.path = outside, block_params, names, path
        self.tags: dict[int, frozenset[int]] = {}
        self.block: int | None = None  # the block running, None outside the blocks
        self.block_args: set[int] = set()
        self.block_made: set[int] = set()
        self.done = -1  # the last block that has returned
        self.used_before: set[str] = set()
        self.used_after: set[str] = set()
        self.modules: list[str] = []  # the modules outside the blocks running, outermost first
        self.dropped: dict[int, str] = {}  # storages of block outputs no stage boundary carries: never read
        self.alive: list[Any] = []
        """Every storage seen, kept alive for the forward: a freed storage's address would be reused
        by a new one and carry its tags (meta storages hold no data: this costs nothing)."""

    def tag(self, t: torch.Tensor) -> frozenset[int]:
        return self.tags.get(_storage(t), frozenset())

    def _where(self) -> str:
        return f"block '{self.path}.{self.names[self.block]}'" if self.block is not None else "the model's forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SHAPE_ONLY:
            return self._record(func(*args, **(kwargs or {})), set(), set())
        ins = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        tag: set[int] = set()
        for t in ins:
            s = _storage(t)
            if s in self.dropped:
                raise _Unsplittable(f"{self._where()} reads {self.dropped[s]} (a stage boundary carries only its "
                                    "first element)")
            aliases = self.outside.get(s)
            if aliases is not None:
                # the name this use goes through: the one under the innermost module running (a
                # tied head's weight is 'lm_head.weight' inside lm_head, 'wte.weight' inside wte)
                name = next((n for m in reversed(self.modules) for n in aliases if n.startswith(m + ".")),
                            aliases[0])
                if self.block is not None:
                    raise _Unsplittable(f"{self._where()} uses the parameter '{name}' that lives outside the blocks")
                (self.used_before if self.done < 0 else self.used_after).add(name)
                tag.add(-1)
                continue
            owner = self.block_params.get(s)
            if owner is not None and owner != self.block:
                raise _Unsplittable(f"{self._where()} uses a parameter of block "
                                    f"'{self.path}.{self.names[owner]}'")
            t_tag = self.tag(t)
            if self.block is not None and t_tag and s not in self.block_args and s not in self.block_made:
                raise _Unsplittable(f"{self._where()} reads a tensor computed outside it that is not one of its "
                                    "arguments")
            if self.block is None and self.done == len(self.names) - 1 and t_tag and self.done not in t_tag:
                raise _Unsplittable(f"after the last block the forward reads a value computed before block "
                                    f"'{self.path}.{self.names[self.done]}' returned (a skip around the blocks)")
            tag |= t_tag
        if self.block is not None:
            tag.add(self.block)
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in ins}
        # a view shares its input's storage and values: it must not tag that storage with this block
        # (RoPE's cos table viewed inside block 0 is still the table every block reads)
        return self._record(out, tag, inputs if not func._schema.is_mutable else set(), inputs)

    def _record(self, out: Any, tag: set[int], views_of: set[int], inputs: frozenset | set = frozenset()) -> Any:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = _storage(t)
                self.alive.append(t.untyped_storage())
                if s in views_of:
                    continue
                if s in inputs:  # written in place: its values now depend on this op's inputs too
                    self.tags[s] = frozenset(tag) | self.tags.get(s, frozenset())
                else:  # a new storage (its address may be a freed one's: forget that one's tags)
                    self.tags[s] = frozenset(tag)
                if self.block is not None:
                    self.block_made.add(s)
        return out


def _first_tensor(obj: Any) -> torch.Tensor | None:
    return next((t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)), None)


def split_layout(model: nn.Module, inputs: tuple) -> SplitLayout:
    """The layout of `model` cut between its blocks, checked on one meta forward of `inputs` (a tuple
    of positional model inputs; any device, only shapes and dtypes are used). ConfigError(model,
    ..., reason) naming the module when it cannot be cut (see the module docstring)."""
    meta = model if all(t.is_meta for t in model.parameters()) else copy.deepcopy(model).to("meta")
    path, container = find_blocks(meta)
    items = block_items(container)
    names = [n for n, _ in items]
    if len(items) < 2:
        raise ConfigError("model", type(model).__name__, "pipeline parallelism cuts a model between repeated blocks, "
                          f"and {'it has none' if not items else 'it has one'}")
    try:
        return _check(meta, path, items, tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs))
    except _Unsplittable as e:
        raise ConfigError("model", type(model).__name__,
                          f"pipeline parallelism cannot cut it between the blocks of '{path}': {e}") from None
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the model's own forward failed on meta: say so in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("model", type(model).__name__,
                          f"pipeline parallelism cannot cut it between the blocks of '{path}' "
                          f"({len(names)} blocks): its forward did not run on the meta device ({first})") from None


def _check(meta: nn.Module, path: str, items: list[tuple[str, nn.Module]], inputs: tuple) -> SplitLayout:
    names = [n for n, _ in items]
    blocks = [b for _, b in items]
    block_params: dict[int, int] = {}
    for k, b in enumerate(blocks):
        for p in b.parameters():
            if _storage(p) in block_params:
                raise _Unsplittable(f"blocks '{path}.{names[block_params[_storage(p)]]}' and '{path}.{names[k]}' "
                                    "share a parameter")
            block_params[_storage(p)] = k
    outside: dict[int, list[str]] = {}
    for n, p in meta.named_parameters(remove_duplicate=False):
        if _storage(p) not in block_params:
            outside.setdefault(_storage(p), []).append(n)
    flow = _Dataflow(outside, block_params, names, path)
    called: list[str] = []
    block_paths = [f"{path}.{n}" if path else n for n in names]

    def in_blocks(n: str) -> bool:
        return n == path or any(n == b or n.startswith(b + ".") for b in block_paths)

    module_names = {m: n for n, m in meta.named_modules() if n and not in_blocks(n)}
    outputs: list[Any] = [None] * len(blocks)
    arity = [0]

    def pre(k: int, mod, args, kwargs):
        first = _first_tensor(args) if args else _first_tensor(kwargs)
        if first is None:
            raise _Unsplittable(f"block '{path}.{names[k]}' takes no tensor")
        if k > 0:
            prev = _first_tensor(outputs[k - 1])
            if prev is None or _storage(prev) != _storage(first) or prev.shape != first.shape:
                raise _Unsplittable(f"block '{path}.{names[k]}' does not take the output of block "
                                    f"'{path}.{names[k - 1]}' as its first input (blocks do not run in sequence)")
        named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"'{n}'", a) for n, a in kwargs.items()]
        for what, value in named:
            if any(isinstance(t, torch.Tensor) and t is not first and flow.tag(t) for t in tree_flatten(value)[0]):
                raise _Unsplittable(f"block '{path}.{names[k]}' takes {what} computed from parameters (of earlier "
                                    "blocks or outside them) besides its input")
        flow.block, flow.block_args, flow.block_made = k, {_storage(t) for t in tree_flatten((args, kwargs))[0]
                                                           if isinstance(t, torch.Tensor)}, set()

    def post(k: int, mod, args, kwargs, out):
        if not isinstance(out, torch.Tensor):
            if not (isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor)):
                n = sum(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0])
                raise _Unsplittable(f"block '{path}.{names[k]}' returns {type(out).__name__} with {n} "
                                    "tensors; a stage boundary carries one (a tensor, or a tuple starting with it)")
            arity[0] = len(out)
            first = _storage(out[0])
            for i, item in enumerate(out[1:], 1):  # carried by no stage boundary: must be read by nothing
                for t in tree_flatten(item)[0]:
                    if isinstance(t, torch.Tensor) and _storage(t) != first:
                        flow.dropped[_storage(t)] = f"element {i} of block '{path}.{names[k]}''s output"
        outputs[k] = out
        flow.block, flow.done = None, k

    def mark_called(mod, args):
        called.append(module_names[mod])
        flow.modules.append(module_names[mod])

    def unmark(mod, args, out):
        flow.modules.pop()

    handles = []
    for k, b in enumerate(blocks):
        handles.append(b.register_forward_pre_hook(lambda m, a, kw, k=k: pre(k, m, a, kw), with_kwargs=True))
        handles.append(b.register_forward_hook(lambda m, a, kw, o, k=k: post(k, m, a, kw, o), with_kwargs=True))
    handles += [m.register_forward_pre_hook(mark_called) for m in module_names]
    handles += [m.register_forward_hook(unmark) for m in module_names]
    try:
        with flow:
            out = meta(*inputs)
    finally:
        for h in handles:
            h.remove()
    if flow.done != len(blocks) - 1 or any(o is None for o in outputs):
        missing = next(n for n, o in zip(names, outputs) if o is None)
        raise _Unsplittable(f"block '{path}.{missing}' was never called")
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and _storage(t) in flow.dropped:
            raise _Unsplittable(f"the model returns {flow.dropped[_storage(t)]} (a stage boundary carries only "
                                "its first element)")
        if isinstance(t, torch.Tensor) and flow.tag(t) and len(blocks) - 1 not in flow.tag(t):
            raise _Unsplittable("the model's output does not depend on the last block")
    both = flow.used_before & flow.used_after
    if both:
        name = sorted(both)[0]
        raise _Unsplittable(f"the parameter '{name}' is used both before the first block and after the last "
                            "(tied input/output embeddings across pipeline stages)")
    every = [n for names in outside.values() for n in names]
    first = tuple(n for n in every if n in flow.used_before)
    last = tuple(n for n in every if n not in flow.used_before)
    return SplitLayout(path, tuple(names), first, last, tuple(dict.fromkeys(called)), arity[0])


def pipeline_reason(model: nn.Module, inputs: tuple) -> str:
    """Why `model` cannot be cut into pipeline stages between its blocks, '' if it can (see
    `split_layout`). Models that declare their first- and last-stage modules (DTorch's reference
    models and adapters: `input_modules` / `output_modules`) are written to be cut: ''."""
    if is_transformers_model(model):
        try:  # the executor cuts a transformers causal LM through its adapter (declared stages)
            model = adapt(model)
        except ConfigError:
            pass
    if declares_stages(model):
        return ""
    try:
        split_layout(model, inputs)
    except ConfigError as e:
        return e.fix
    return ""


def declares_stages(model: nn.Module) -> bool:
    """Whether the model says which modules its first and last pipeline stages hold, and keeps its
    blocks in an nn.ModuleDict, so that a stage is the model with the others' modules set to None
    (DTorch's reference models and transformers adapters)."""
    try:
        _, container = find_blocks(model)
    except ConfigError:
        return False
    return hasattr(model, "input_modules") and hasattr(model, "output_modules") and isinstance(container, nn.ModuleDict)


def submodule(model: nn.Module, path: str) -> nn.Module | None:
    """`model` itself for the empty path, else the submodule at `path` (None if absent)."""
    return model if not path else get_submodule(model, path)
