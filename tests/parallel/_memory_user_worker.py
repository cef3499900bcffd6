"""The worker of tests/plan/test_memory_user_models.py: one steady-state step of a plan on a model
DTorch did not write, under torch's MemTracker (the machinery of `_memory_worker`, imported), the
rank's peak by category. The factories are here so that both the planner (`profile` of the spec
`_memory_user_worker:<name>`) and the executor (`parallelize` of the same function) build the
user's model the same way.

- `gpt2`: transformers' GPT2LMHeadModel from a tiny config, its defaults otherwise (tied embedding
  and head, dropout 0.1, GeLU, LayerNorm, fused Conv1D projections).
- `llama`: transformers' LlamaForCausalLM from a tiny config (GQA, SwiGLU, RMSNorm, RoPE, untied).
- The non-language model is `_user_cnn:cnn` (tests/plan, SmallCNN, with its `example_input`).
"""

from __future__ import annotations

import importlib

import torch
from _memory_worker import SEQ, _BucketRecorder, steady_peak

VOCAB = 256


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=1))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0))


def _factory(spec: str):
    module, _, name = spec.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, name), getattr(mod, "example_input", None)


def _batches(spec: str, rows: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` global batches of `rows` samples: token ids (next-token targets) for a language model,
    else the factory module's example inputs and targets, repeated to `rows` (fresh values)."""
    g = torch.Generator().manual_seed(0)
    _, example = _factory(spec)
    if example is None:
        out = []
        for _ in range(n):
            x = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
            out.append((x[:, :-1], x[:, 1:]))
        return out
    x0, y0 = example()
    shape = (rows, *x0.shape[1:])
    return [(torch.randn(shape, generator=g), torch.randint(0, int(y0.max()) + 1, (rows,), generator=g))
            for _ in range(n)]


def measure(case, rank):
    """One steady-state step of `case` = (spec, plan fields) on this rank: the peak's bytes by
    category (as `_memory_worker.measure`, with the user's factory and loss)."""
    from dtorch.parallel import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import cross_entropy, next_token

    torch.set_num_threads(1)
    spec, fields = case
    plan = Plan(**fields)
    factory, example = _factory(spec)
    loss = next_token if example is None else cross_entropy
    sample = None if example is None else (example()[0][:plan.microbatch_size],)
    buckets = _BucketRecorder()
    try:
        pm = parallelize(factory, plan, loss_fn=loss, seed=0, seq_len=SEQ if example is None else None,
                         sample=sample)
    finally:
        buckets.restore()
    opt = torch.optim.AdamW(list(pm.parameters()), lr=1e-3, foreach=False)
    local = pm.local_batch
    rows = slice(pm.dp_rank * local, (pm.dp_rank + 1) * local)
    batches = _batches(spec, plan.dp * local, 3)
    # each rank holds its own rows only, as the trainer loads them (`batch_for`): a view would keep
    # the whole global batch alive, which for an image input is a measurable share of the activations
    return steady_peak(pm, opt, buckets, [(x[rows].clone(), y[rows].clone()) for x, y in batches])

