"""Tensor-parallel roles of a model's layers: the one rule the profiler (is TP offered, and why not)
and the executor (dtorch.parallel.tp: how each layer is split) share.

Roles (Megatron's column -> row chain): q/k/v and MLP up/gate are column-wise (each rank owns whole
heads / a slice of the hidden units), the attention output and MLP down projections are row-wise.
They come from layer names (DTorch reference models, Hugging Face families, ROLE_BY_NAME) or from
`annotate(module, role)`; a Linear without a role is an error that names it, and so is a fused
projection (q|k|v or gate|up side by side, FUSED) whose layout is not per head.

`mark_region` finds the parameters left whole inside the TP region (between a column-wise layer and
the row-wise layer that reduces its output), whose gradient is a sum over the TP group.
"""

from __future__ import annotations

import copy
import inspect
from functools import partial

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtorch.errors import ConfigError
from dtorch.model.structure import ROLE_HELP, block_items, find_blocks

ROLES = ("colwise", "rowwise", "embedding", "output", "replicate")
ROLE_BY_NAME = {
    # DTorch reference models (torchtitan names)
    "wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise",
    "w1": "colwise", "w3": "colwise", "w2": "rowwise",
    # mixtures of experts (dtorch.models.moe): the router is small and must see whole tokens; the
    # routed experts are not Linear layers and are split by dtorch.parallel.expert instead
    "router": "replicate", "shared_expert_gate": "replicate",
    # DeepSeek's latent attention: the low-rank down-projections stay whole (their output is the
    # shared latent every head reads), the up-projections split by heads
    "wq_a": "replicate", "wkv_a": "replicate", "wq_b": "colwise", "wkv_b": "colwise",
    # Hugging Face Llama and relatives (Mistral, Qwen, Gemma, OLMo, Mixtral's and Qwen-MoE's attention)
    "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
    "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise",
    # GPT-NeoX: query_key_value is fused per head ([head][q|k|v] rows, viewed as (-1, 3 * head_dim)),
    # so a contiguous column split gives each rank whole heads of q, k and v
    "attention.query_key_value": "colwise", "attention.dense": "rowwise",
    "dense_h_to_4h": "colwise", "dense_4h_to_h": "rowwise",
}
FUSED = ("qkv_proj", "gate_up_proj", "qkv", "Wqkv", "W_pack", "c_attn", "query_key_value", "c_fc")
"""Fused projections of several tensors (q|k|v, gate|up) side by side: a column split would give one
rank all of q and another all of v. Without a role (ROLE_BY_NAME: those whose layout is per head)
tensor parallelism is not offered for the model, naming the layer."""
TOP_ROLE_BY_NAME = {
    "tok_embeddings": "embedding", "embed_tokens": "embedding",
    "output": "output", "lm_head": "output",
}


def annotate(module: nn.Module, role: str) -> nn.Module:
    """Declare the tensor-parallel role of a layer the executor cannot name: one of ROLES.
    'colwise' splits output features, 'rowwise' input features (it must follow a colwise layer),
    'replicate' keeps the layer whole on every TP rank."""
    if role not in ROLES:
        raise ConfigError("role", role, "use one of {" + ", ".join(ROLES) + "}")
    module._dtorch_tp_role = role
    return module


def _role(name: str, module: nn.Module, table: dict[str, str]) -> str | None:
    parts = name.split(".")
    return (getattr(module, "_dtorch_tp_role", None) or table.get(".".join(parts[-2:]))
            or table.get(parts[-1]))


def check_block(block: nn.Module, block_name: str) -> dict[str, str]:
    """{layer name: role} of the block's Linear (and annotated) layers; ConfigError naming the first
    layer that has none, or a fused projection that cannot be split per head."""
    roles: dict[str, str] = {}
    for name, mod in block.named_modules():
        if type(mod).__name__ == "Conv1D" and not getattr(mod, "_dtorch_tp_role", None):
            # transformers' Conv1D stores the weight transposed, and GPT-2 fuses q, k, v in one:
            # no column split of it is head-aligned.
            raise ConfigError(
                "tp", f"{block_name}.{name}",
                "this fused Conv1D projection cannot be split head-aligned; use tp=1 (FSDP, DDP and PP work)",
            )
        if isinstance(mod, nn.Linear) or getattr(mod, "_dtorch_tp_role", None):
            role = _role(name, mod, ROLE_BY_NAME)
            if role is None and name.rsplit(".", 1)[-1] in FUSED:
                raise ConfigError(
                    "tp", f"{block_name}.{name}",
                    "a fused projection (q|k|v or gate|up side by side) whose layout is not split per head; "
                    "use tp=1 (FSDP, DDP and PP work)",
                )
            if role is None:
                raise ConfigError(
                    "model", f"{block_name}.{name}",
                    f"no tensor-parallel role for this {type(mod).__name__}; {ROLE_HELP}",
                )
            roles[name] = role
    return roles


# ---- heads, not tokens: what a rank's attention sees --------------------------------------------
# A column-wise split gives each rank a slice of the q/k/v features, which is whole heads only if
# the attention reshapes them with the head count left to the shape (view(b, s, -1, head_dim)). One
# that names the model's total head count and leaves the sequence to the shape (OPT's
# view(b, -1, num_heads, head_dim)) reads a rank's half of the features as half as many tokens:
# every shape still fits and the result is wrong. So the blocks run once more on the meta device
# with each column-wise layer's outputs and each row-wise layer's inputs halved, as a rank of two
# holds them, and every attention core must see the same sequence and head size as in the whole
# model: SDPA's query and key lengths and head dimension, and an unfused attention's s x s scores.
_HEADS_ATTR = "_dtorch_tp_heads_checked"
_SEQ = 8
"""Tokens of the check's forward (as `mark_region`'s)."""


class _AttentionShapes(TorchDispatchMode):
    """Records, in call order, the sequence and head sizes each attention core sees: SDPA's (query
    length, key length, head dim), and the last two dims of every batched matmul's output (an unfused
    attention's scores among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.sdpa: list[tuple[int, int, int]] = []
        self.bmm: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        if "scaled_dot_product" in name and "backward" not in name:
            q, k = args[0], args[1]
            self.sdpa.append((int(q.shape[-2]), int(k.shape[-2]), int(q.shape[-1])))
        elif name.split(".")[0] in ("bmm", "baddbmm") and isinstance(out, torch.Tensor) and out.dim() >= 2:
            self.bmm.append((int(out.shape[-2]), int(out.shape[-1])))
        return out


def _attention_shapes(model: nn.Module) -> tuple[_AttentionShapes | None, str]:
    device = next(model.parameters()).device
    rec = _AttentionShapes()
    try:
        with torch.no_grad(), rec:
            model(torch.zeros(1, _SEQ, dtype=torch.long, device=device))
    except Exception as e:  # noqa: BLE001 - the user's code: one line
        return None, f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    return rec, ""


def halve_linears(block: nn.Module, roles: dict[str, str], device: str = "meta") -> None:
    """Replace the block's column-wise nn.Linear layers by ones with half the outputs and its
    row-wise ones by ones with half the inputs (on `device`), as a TP rank of two holds them."""
    for name, role in roles.items():
        if role not in ("colwise", "rowwise"):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = block.get_submodule(parent_name) if parent_name else block
        old = getattr(parent, leaf)
        if not isinstance(old, nn.Linear):
            raise ValueError(name)
        inp, out = (old.in_features, old.out_features // 2) if role == "colwise" else (old.in_features // 2,
                                                                                         old.out_features)
        setattr(parent, leaf, nn.Linear(inp, out, bias=old.bias is not None, device=device, dtype=old.weight.dtype))


def check_heads(model: nn.Module) -> None:
    """Raise ConfigError("tp", first block) when the blocks' attention does not split by heads under
    tensor parallelism (see above): run on the meta device with the column-wise layers halved, it sees
    another sequence length or head size, or fails where the whole model runs. Nothing is checked
    where the whole model's forward of token ids does not run on the meta device; a model that is not
    on the meta device (the planner's and the executor's are) is not checked. Once per model."""
    if getattr(model, _HEADS_ATTR, False) or not all(p.is_meta for p in model.parameters()):
        return
    whole, _ = _attention_shapes(model)
    if whole is None or not (whole.sdpa or any(d == (_SEQ, _SEQ) for d in whole.bmm)):
        object.__setattr__(model, _HEADS_ATTR, True)
        return
    half_model = copy.deepcopy(model)
    path, blocks = find_blocks(half_model)
    items = block_items(blocks)
    for _, block in items:  # (an annotated layer that is not an nn.Linear stays whole)
        halve_linears(block, {n: r for n, r in layer_roles(block).items()
                              if isinstance(block.get_submodule(n), nn.Linear)})
    half, error = _attention_shapes(half_model)
    where = f"{path}.{items[0][0]}" if path else items[0][0]
    fix = "use tp=1 (FSDP, DDP and PP work), or reshape q/k/v with -1 for the head count"
    if half is None:
        raise ConfigError("tp", where, f"its forward fails when a rank holds half of the heads ({error}): the "
                          f"attention reshapes by the model's total head count; {fix}")
    scores = [i for i, d in enumerate(whole.bmm) if d == (_SEQ, _SEQ)]  # an unfused attention's s x s
    if (half.sdpa != whole.sdpa or len(half.bmm) != len(whole.bmm)
            or any(half.bmm[i] != whole.bmm[i] for i in scores)):
        raise ConfigError("tp", where, "its attention sees a shorter sequence or another head size when a rank "
                          "holds half of the heads: it reshapes q/k/v by the model's total head count (e.g. "
                          f"view(batch, -1, num_heads, head_dim)), which would read the heads as tokens; {fix}")
    object.__setattr__(model, _HEADS_ATTR, True)


# ---- replicated parameters inside the tensor-parallel region ------------------------------------
# Between a column-wise layer and the row-wise layer that reduces its output, each rank computes on
# its own heads / hidden units only. A parameter left whole there (Qwen3's and Gemma 3's per-head
# q/k norms, a scale on the attention output) gets from each rank the gradient of that rank's part:
# its true gradient is the SUM over the TP group. Parameters before the column-wise layer (the
# block's input norm) already get the whole gradient (ColwiseParallel reduces its input's), and so do
# those after the row-wise reduction. Which side a parameter is on is data flow, not structure
# (DeepSeek's latent attention has norms between two column-wise layers, on the replicated side), so
# it is found by one forward of the model on its own device (meta: free) that follows the values
# computed from column-wise outputs until a row-wise layer sums them. The module holding such a
# parameter is then run as data parallel over the TP group: its input, this rank's part, is taken
# as shard 0 of a tensor the group holds, its parameters become Replicate DTensors, and their
# gradients come back Partial and are summed once per step (ParallelModel._reduce_partial_grads),
# exactly as a sequence-parallel norm's. Valid for any module whose output rows depend only on the
# same input rows (norms, scales, biases, linear maps): not for one that mixes the rows of dim 0.
REGION_ATTR = "_dtorch_tp_region"
SP_WHOLE_ATTR = "_dtorch_sp_whole"
"""On a block's child under sequence parallelism: it gathers the whole sequence on entry and keeps
this rank's shard of its output (tp.apply_tp), so its parameters see every token on every rank."""
_ANALYSED_ATTR = "_dtorch_tp_region_analysed"


def layer_roles(block: nn.Module) -> dict[str, str]:
    """{layer name: role} of the block's layers that have one (annotation or ROLE_BY_NAME)."""
    return {name: role for name, mod in block.named_modules()
            if (isinstance(mod, nn.Linear) or getattr(mod, "_dtorch_tp_role", None))
            and (role := _role(name, mod, ROLE_BY_NAME)) is not None}


class _Flow(TorchFunctionMode):
    """Follows tensors computed from column-wise outputs (`hot`), recording for every nn.Parameter
    that meets one, directly or through values computed from it alone (`self.weight.float()`), the
    shapes of the hot tensors it met."""

    def __init__(self) -> None:
        super().__init__()
        self.keep: list[torch.Tensor] = []  # every tensor seen stays alive, so that ids stay unique
        self.hot: set[int] = set()
        self.origin: dict[int, set[int]] = {}  # tensor id -> the parameters it was computed from, alone
        self.met: dict[int, list[torch.Size]] = {}

    def heat(self, value, on: bool = True) -> None:
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor):
                self.keep.append(t)
                (self.hot.add if on else self.hot.discard)(id(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        hot = [t.shape for t in leaves if id(t) in self.hot]
        params = {i for t in leaves
                  for i in ({id(t)} if isinstance(t, nn.Parameter) else self.origin.get(id(t), set()))}
        if hot:
            for i in params:
                self.met.setdefault(i, []).extend(hot)
            self.heat(out)
        elif params and all(isinstance(t, nn.Parameter) or id(t) in self.origin for t in leaves):
            # computed from parameters alone (no activation): still "the parameter" where it meets one
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
                    self.keep.append(t)
                    self.origin[id(t)] = params
        return out


def is_sp_norm(name: str, module: nn.Module) -> bool:
    """A norm that sequence parallelism runs on sequence shards itself (SequenceParallel)."""
    return "norm" in name.rsplit(".", 1)[-1] and not list(module.children())


def _region_candidates(block: nn.Module, sp: bool) -> list[str]:
    """Modules with parameters of their own and no role, under a module that owns a column-wise layer
    or, with sequence parallelism, anywhere in the block but the sequence-parallel norms."""
    roles = layer_roles(block)
    owners = {n.rpartition(".")[0] for n, r in roles.items() if r == "colwise"}
    out = []
    for name, mod in block.named_modules():
        if (name in roles or any(name.startswith(r + ".") for r in roles)
                or not any(True for _ in mod.parameters(recurse=False))):
            continue
        if any(o == "" or name.startswith(o + ".") for o in owners) or (sp and not is_sp_norm(name, mod)):
            out.append(name)
    return out


def _first_input_cooled(flow: _Flow, module: nn.Module, args: tuple, kwargs: dict):
    """The executor gathers the whole sequence on entry to a module owning a column-wise layer
    (tp.gather_sequence_on_entry): from there on its first input is no longer a shard."""
    def cool(x):
        if not isinstance(x, torch.Tensor):
            return x
        y = x.view_as(x)
        flow.heat(y, False)
        return y

    if args:
        return (cool(args[0]), *args[1:]), kwargs
    first = next(iter(inspect.signature(module.forward).parameters))
    return args, {**kwargs, first: cool(kwargs[first])} if first in kwargs else kwargs


def _unwrappable(mod: nn.Module, entered: tuple[int, bool] | None) -> bool:
    return any(True for c in mod.children() for _ in c.parameters()) or (entered or (1, False))[0] > 1


def _whole_children(block: nn.Module, candidates: list[str], verdict: dict, entered: dict) -> set[str]:
    """Under SP, the block children (a mixture of experts: a router and experts taking several tensors)
    holding a sequence-shard parameter that cannot run as data parallel over the TP group: they run
    on the whole sequence instead, when they take one tensor and hold no tensor-parallel layer.
    (`entered`: by module name within a block, from the blocks the forward reached.)"""
    roles = layer_roles(block)
    out = set()
    for cname in candidates:
        top = cname.split(".")[0]
        if (cname != top and verdict.get(cname) and _unwrappable(block.get_submodule(cname), entered.get(cname))
                and entered.get(top) == (1, True) and not any(n == top or n.startswith(top + ".") for n in roles)):
            out.add(top)
    return out


def _entered(flow: _Flow, entered: dict, module: nn.Module, args: tuple, kwargs: dict) -> None:
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    entered[id(module)] = (len(tensors), any(id(t) in flow.hot for t in tensors))


def mark_region(model: nn.Module, sp: bool = False, seq_len: int = 8) -> None:
    """Set REGION_ATTR on every block module whose parameters are used inside the TP region (see
    above), once per model and `sp`. With sequence parallelism the region also holds what runs on
    the block's sequence shards outside the column-wise modules (Gemma's norms after the attention,
    a mixture of experts' router). Raises ConfigError ("tp", or "sp" for what only sequence
    parallelism puts in the region) naming a module where the rule cannot hold: one that also has
    submodules with parameters, one that takes more than one tensor, or one whose parameter spans all
    heads' features of a column-wise output (OLMo 2's q_norm normalises over all heads)."""
    if getattr(model, _ANALYSED_ATTR, None) == sp:
        return
    path, blocks = find_blocks(model)
    items = block_items(blocks)
    for _, block in items:  # a new analysis (another sp) starts from no marks
        for mod in block.modules():
            for attr in (REGION_ATTR, SP_WHOLE_ATTR):
                if getattr(mod, attr, False):
                    object.__setattr__(mod, attr, False)
    candidates = {name: _region_candidates(block, sp) for name, block in items}
    if not any(candidates.values()):
        object.__setattr__(model, _ANALYSED_ATTR, sp)
        return
    flow = _Flow()
    reached: set[int] = set()
    entered: dict[int, tuple[int, bool]] = {}  # module id -> (tensor inputs, any of them hot)
    hooks = []
    for bname, block in items:
        roles = layer_roles(block)
        for name, role in roles.items():
            if role in ("colwise", "rowwise"):
                hooks.append(block.get_submodule(name).register_forward_hook(
                    lambda m, a, out, on=role == "colwise": flow.heat(out, on)))
        for cname in candidates[bname]:
            hooks.append(block.get_submodule(cname).register_forward_pre_hook(partial(_entered, flow, entered),
                                                                               with_kwargs=True))
            hooks.append(block.get_submodule(cname).register_forward_hook(lambda m, a, out: reached.add(id(m))))
        if sp:  # the block runs on sequence shards, the modules owning column-wise layers on whole ones
            hooks.append(block.register_forward_pre_hook(lambda m, a, kw: flow.heat(a[:1] or kw), with_kwargs=True))
            for _, child in block.named_children():
                hooks.append(child.register_forward_pre_hook(partial(_entered, flow, entered), with_kwargs=True))
            for owner in {n.rpartition(".")[0] for n, r in roles.items() if r == "colwise"} - {""}:
                hooks.append(block.get_submodule(owner).register_forward_pre_hook(
                    partial(_first_input_cooled, flow), with_kwargs=True))
    device = next(model.parameters()).device
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device=device)
    error = None
    try:
        with torch.no_grad(), flow:
            model(tokens)
    except Exception as e:  # noqa: BLE001 - meta cannot run everything (a MoE's grouped matmul): what ran counts
        error = f"{type(e).__name__}: {e}"
    finally:
        for h in hooks:
            h.remove()
    # a module the forward did not reach takes the verdict of the same module of a block it reached
    by_name: dict[str, tuple[int, bool]] = {}
    for _, block in items:
        for n, m in block.named_modules():
            if id(m) in entered:
                by_name.setdefault(n, entered[id(m)])
    verdict: dict[str, list[torch.Size]] = {}
    for bname, block in items:
        for cname in candidates[bname]:
            mod = block.get_submodule(cname)
            met = [shape for p in mod.parameters(recurse=False) for shape in flow.met.get(id(p), [])]
            if id(mod) in reached:
                verdict[cname] = verdict.get(cname, []) + met
            elif entered.get(id(mod), (0, False))[1]:  # the forward failed inside it, on region inputs
                verdict[cname] = verdict.get(cname, []) + (met or [torch.Size()])
    for bname, block in items:
        widths = {mod.out_features for n, mod in block.named_modules()
                  if isinstance(mod, nn.Linear) and layer_roles(block).get(n) == "colwise"}
        whole = _whole_children(block, candidates[bname], verdict, by_name) if sp else set()
        for top in whole:
            object.__setattr__(block.get_submodule(top), SP_WHOLE_ATTR, True)
        for cname in candidates[bname]:
            if cname.split(".")[0] in whole:
                continue  # runs on the whole sequence, as on one process: its gradients are complete
            mod = block.get_submodule(cname)
            where = f"{path}.{bname}.{cname}"
            field = "sp" if sp and cname not in _region_candidates(block, False) else "tp"
            if cname not in verdict:
                raise ConfigError(field, where, "cannot tell whether this parameter is inside the tensor-parallel "
                                  f"region: a forward of token ids on {device} did not reach it ({error}); "
                                  f"use {field}={'false' if field == 'sp' else '1'}")
            met = verdict[cname]
            if not met:
                continue
            if field == "tp" and any(len(shape) and shape[-1] in widths and p.shape and p.shape[-1] == shape[-1]
                   for p in mod.parameters(recurse=False) for shape in met):
                raise ConfigError(field, where, "its parameter spans the features of all heads of a column-wise "
                                  "layer (e.g. a q/k norm over the whole projection), which no rank holds under "
                                  "tensor parallelism; use tp=1 (FSDP, DDP and PP work)")
            if _unwrappable(mod, by_name.get(cname)):
                raise ConfigError(field, where, "a module with parameters used inside the tensor-parallel region "
                                  "(on this rank's heads or sequence shard only) that DTorch cannot run as data "
                                  "parallel over the TP group (it takes several tensors, or has submodules with "
                                  f"parameters); use {field}={'false' if field == 'sp' else '1'}")
            object.__setattr__(mod, REGION_ATTR, True)
    object.__setattr__(model, _ANALYSED_ATTR, sp)
