"""Tiny configs of the transformers causal LMs DTorch adapts as factories (issue 27 item 7), and
the world-2 worker of test_hf_any.py (here: spawned ranks import it without the test module).

`config(arch, attn)` is a fresh config (2 layers, hidden 32, vocab 128, 4 heads, 2 kv heads where the
family has GQA); Mistral, Gemma and Qwen2 carry a sliding window shorter than the tests' sequence
(16) so that the window is exercised. Embeddings are untied (ties are another change's concern)."""

from __future__ import annotations

from functools import partial

import torch

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
               bos_token_id=0, eos_token_id=1, pad_token_id=0)
ARCHS = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=6)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=8)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": ("Gemma2Config", dict(head_dim=8, sliding_window=6)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=8, sliding_window=6, sliding_window_pattern=2)),
    "phi3": ("Phi3Config", {}),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                 attn_pdrop=0.0)),
    "gpt_neox": ("GPTNeoXConfig", dict(num_key_value_heads=None)),
    "olmo2": ("Olmo2Config", {}),
    # ALiBi, fused per-head query_key_value, an embedding LayerNorm, and blocks that return their
    # attention probabilities beside the hidden states: the model's own forward, not an adapter
    "bloom": ("BloomConfig", {}),
    "bloom_tied": ("BloomConfig", dict(tie_word_embeddings=True)),  # BLOOM's own default: head = embedding
    "opt": ("OPTConfig", dict(ffn_dim=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                             embd_pdrop=0.0, attn_pdrop=0.0)),
    "mpt": ("MptConfig", dict(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64)),
    "falcon": ("FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "gptj": ("GPTJConfig", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0)),
}
EAGER_ONLY = {"gemma2", "bloom", "bloom_tied", "mpt"}  # transformers has no SDPA kernel for Gemma 2 (attention soft-capping)


def config(arch: str, attn: str = "sdpa"):
    import transformers

    cls, extra = ARCHS[arch]
    kwargs = {**_COMMON, **extra}
    if arch == "gpt2":
        kwargs = {k: v for k, v in kwargs.items() if k in ("vocab_size", "tie_word_embeddings", "bos_token_id",
                                                           "eos_token_id")} | extra
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    cfg = getattr(transformers, cls)(**kwargs)
    cfg._attn_implementation = attn
    return cfg


def factory(arch: str, attn: str = "sdpa"):
    """The user's factory: `AutoModelForCausalLM.from_config` of the tiny config."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config(arch, attn), attn_implementation=attn)


# ---- world-2 training against a plain single-process loop (test_hf_any.py) ---------------------
SEQ = 16
STEPS, LR, BATCH = 5, 3e-3, 4
PLANS = {"ddp": dict(dp_replicate=2, microbatch_size=2), "tp": dict(tp=2, microbatch_size=4),
         "fsdp": dict(dp_shard=2, microbatch_size=2), "tp_sp": dict(tp=2, sp=True, microbatch_size=4),
         "pp": dict(pp=2, microbatch_size=2, num_microbatches=2),
         # a model run as written keeps no KV cache: a re-run block must not append to one
         "fsdp_full": dict(dp_shard=2, microbatch_size=2, ac="full"),
         # selective AC under TP re-runs the row-wise linears' partial sums (dtorch.parallel.ac)
         "tp_selective": dict(tp=2, microbatch_size=4, ac="selective"),
         "tp_sp_selective": dict(tp=2, sp=True, microbatch_size=4, ac="selective")}
def _factory(arch: str, attn: str):
    if arch == "dtorch-moe-qk-norm":
        import dataclasses

        from dtorch.models.configs import model_config
        from dtorch.models.moe import MoETransformer

        return MoETransformer(dataclasses.replace(model_config("moe-tiny"), qk_norm=True, vocab_size=VOCAB))
    return factory(arch, attn)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def _single_process(arch: str, attn: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain loop: the model the parallel run starts from (materialize's rule per model kind),
    5 AdamW steps on the whole batch; the losses and the first step's gradients by name."""
    from dtorch.model.outputs import logits_of
    from dtorch.parallel.materialize import init_model
    from dtorch.train.losses import next_token

    torch.manual_seed(0)
    model = _adapt(_factory(arch, attn))
    if arch.startswith("dtorch"):
        init_model(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = _batch(step)
        loss = next_token(logits_of(model(x)), y)
        loss.backward()
        if step == 0:
            # a tied weight under both of its names (a pipeline's last stage holds the head's)
            grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, grads


def world2_worker(case: list, rank: int) -> dict:
    from dtorch.parallel import parallelize
    from dtorch.parallel.materialize import clean_name
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    arch, attn, plan_name = case
    ref_losses, ref_grads = _single_process(arch, attn)
    plan = Plan(**PLANS[plan_name])
    pm = parallelize(partial(_factory, arch, attn), plan, loss_fn=next_token, seed=0, seq_len=SEQ)
    opt = torch.optim.AdamW(list(pm.parameters()), lr=LR, foreach=False)
    rows = slice(pm.dp_rank * pm.local_batch, (pm.dp_rank + 1) * pm.local_batch)
    losses, worst = [], (0.0, "")
    for step in range(STEPS):
        x, y = _batch(step)
        losses.append(float(pm.forward_backward(x[rows], y[rows])))
        if step == 0:  # every gradient, sharded or replicated, against the single-process one
            # relative to the gradient's own size, floored at 1e-4 of the largest one: some vanish in
            # exact arithmetic (a key bias under softmax) and are float32 noise on both sides
            floor = 1e-4 * max(float(g.abs().max()) for g in ref_grads.values())
            for name, p in pm.named_parameters():
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                ref = ref_grads[clean_name(name)]
                rel = float((g - ref).abs().max()) / max(float(ref.abs().max()), floor)
                worst = max(worst, (rel, clean_name(name)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "ref": ref_losses, "worst_grad": worst, "grads": len(ref_grads)}




def _adapt(model):
    from dtorch.parallel.hf import adapt

    return adapt(model)


def _matrix() -> None:
    """The full matrix, benchmark-style (the suite runs a representative subset): every architecture
    x attention x {ddp, fsdp, tp, tp_sp, pp} at world 2, one group of gloo processes; prints each
    case's worst relative loss difference and worst gradient, or the one-line refusal. ~4 min.

        .venv/bin/python tests/parallel/_hf_archs.py [arch,arch,...]
    """
    import sys
    import time

    from _harness import run_group

    archs = sys.argv[1].split(",") if len(sys.argv) > 1 else list(ARCHS)
    cases = [[a, attn, p] for a in archs for attn in ("eager", "sdpa") if not (attn == "sdpa" and a in EAGER_ONLY)
             for p in PLANS]
    start = time.time()
    for case, ranks in zip(cases, run_group(2, cases, world2_worker)):
        errors = [r["error"].strip().splitlines()[-1] for r in ranks if "error" in r]
        if errors:
            print(f"{'/'.join(case):28s} {errors[0][:160]}")
            continue
        loss = max(abs(a - b) / abs(b) for r in ranks for a, b in zip(r["losses"], r["ref"]))
        grad = max(r["worst_grad"][0] for r in ranks)
        print(f"{'/'.join(case):28s} loss {loss:.1e}  grad {grad:.1e}  {'ok' if max(loss, grad) < 1e-5 else 'FAIL'}")
    print(f"{len(cases)} cases in {time.time() - start:.0f} s")


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _hf_archs  # the workers must be importable by this name in the spawned ranks

    _hf_archs._matrix()
