"""The training loop both sides of the loss-equivalence test run: 5 AdamW steps in float32."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch

from dtorch.plan.plan import Plan
from dtorch.train.losses import next_token

STEPS = 5
SEQ = 16
VOCAB = 256
LR = 3e-3


def factory(name: str = "llama-tiny"):
    """A tiny model by name: reference models ("llama-tiny" with 8 query / 4 key-value heads, so
    that tp=4 divides both; "gpt-tiny"), or transformers models from a config ("hf-llama",
    "hf-gpt2"; no download), seen through DTorch's adapter."""
    if name == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=0, eos_token_id=1))
    if name == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=64, tie_word_embeddings=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1))
    from dtorch.models import build_model

    return build_model(name, heads=8, kv_heads=4) if name.startswith("llama") else build_model(name)


@contextmanager
def one_thread():
    """The body on one intra-op thread, as every rank of a group runs (`_harness`). A reference
    on torch's default threads of a busy 2-core machine waits on OpenMP barriers: 5-20x slower
    for these tiny models (the summation order differs by float32 rounding only)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def batch(step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


@one_thread()
def single_process(global_batch: int, model_name: str = "llama-tiny", seed: int = 0,
                   dropout_seed: int | None = None) -> dict:
    """Reference: the whole global batch in one forward on one process. `dropout_seed` seeds
    torch's generator before training (what a one-rank plan with that seed draws)."""
    from dtorch.parallel.hf import adapt
    from dtorch.parallel.materialize import init_model

    if model_name.startswith("hf-"):  # transformers: seed, then construct (its own init)
        torch.manual_seed(seed)
        model = adapt(factory(model_name))
    else:
        model = factory(model_name)
        init_model(model, seed)
    if dropout_seed is not None:
        torch.manual_seed(dropout_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step, global_batch)
        loss = next_token(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "keys": sorted(model.state_dict())}


def parallel(plan_kwargs: dict, rank: int, seed: int = 0) -> dict:
    """`plan_kwargs`: Plan fields, plus optionally "model" (a reference model spec)."""
    from dtorch.parallel import parallelize

    plan_kwargs = dict(plan_kwargs)
    model_name = plan_kwargs.pop("model", "llama-tiny")
    plan = Plan(**plan_kwargs)
    pm = parallelize(partial(factory, model_name), plan, loss_fn=next_token, seed=seed, seq_len=SEQ)
    masks = record_masks(pm.model_parts)
    opt = torch.optim.AdamW(list(pm.parameters()), lr=LR, foreach=False)
    local = pm.local_batch  # this rank's share (plan.dp_shares) or the even local batch
    start = plan.microbatch_size * sum(plan.dp_shares[:pm.dp_rank]) if plan.dp_shares else pm.dp_rank * local
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step, plan.dp * plan.local_batch())
        rows = slice(start, start + local)
        loss = pm.forward_backward(x[rows], y[rows])
        norms.append(float(pm.clip_grad_norm_(1e9)))
        opt.step()
        if step == STEPS - 1:
            states = state_bytes(list(pm.parameters()), opt)
        opt.zero_grad()
        losses.append(float(loss))
        for h in masks.pop("_hooks", []):
            h.remove()
    return {"losses": losses, "norms": norms, "keys": sorted(pm.state_dict_for_checkpoint()), "masks": masks,
            "state_bytes": states}


def state_bytes(params: list, opt: torch.optim.Optimizer) -> dict:
    """This rank's model-state bytes (local shards): parameters, gradients, AdamW's moments."""
    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    return {"params": sum(local(p) for p in params),
            "grads": sum(local(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(local(v) for st in opt.state.values() for k, v in st.items()
                             if k != "step" and torch.is_tensor(v))}


def record_masks(parts: list[torch.nn.Module]) -> dict:
    """{dropout module name: [fingerprint of every mask it drew in the first step]}, a fingerprint
    being (elements, dropped elements, sum of the dropped elements' flat indices): equal
    fingerprints mean equal masks. A recomputed block (activation checkpointing) records again."""
    from dtorch.parallel.materialize import clean_name

    out: dict = {}
    hooks = []

    def hook(name, module, args, output):
        local = output.to_local() if hasattr(output, "to_local") else output
        dropped = (local == 0).flatten().nonzero()
        out.setdefault(name, []).append([local.numel(), dropped.numel(), int(dropped.sum())])

    for part in parts:
        for name, mod in part.named_modules():
            if isinstance(mod, torch.nn.Dropout):
                hooks.append(mod.register_forward_hook(partial(hook, clean_name(name))))
    out["_hooks"] = hooks
    return out


@one_thread()
def pipeline_oracle(plan_kwargs: dict, seed: int = 0) -> dict:
    """Single process, the masks the dropout rule gives a pipeline (dtorch/parallel/rng.py): stage
    s draws from the stream of pipeline rank s, its micro-batches in order. Only for schedules that
    run one stage per rank (gpipe, 1f1b) and pp as the only axis."""
    from dtorch.parallel.materialize import init_model
    from dtorch.parallel.pipeline import split_stage
    from dtorch.parallel.rng import rank_seed

    kwargs = dict(plan_kwargs)
    model_name = kwargs.pop("model", "llama-tiny")
    plan = Plan(**kwargs)
    assert plan.world_size == plan.pp and plan.virtual_stages == 1, plan
    full = factory(model_name)
    init_model(full, seed)
    stages = [split_stage(full, plan, s) for s in range(plan.pp)]
    states = []
    for s in range(plan.pp):
        torch.manual_seed(rank_seed(seed, plan, {"pp": s}))
        states.append(torch.get_rng_state())
    params = [p for st in stages for p in st.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    n = plan.num_microbatches
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step, plan.local_batch())
        total = 0.0
        for xi, yi in zip(x.chunk(n), y.chunk(n)):
            h = xi
            for s, st in enumerate(stages):
                torch.set_rng_state(states[s])
                h = st(h)
                states[s] = torch.get_rng_state()
            loss = next_token(h, yi) / n
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1e9)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms}
