"""Tiny configs of the transformers causal LMs DTorch adapts as factories (issue 27 item 7).

`config(arch, attn)` is a fresh config (2 layers, hidden 32, vocab 128, 4 heads, 2 kv heads where the
family has GQA); Mistral, Gemma and Qwen2 carry a sliding window shorter than the tests' sequence
(16) so that the window is exercised. Embeddings are untied (ties are another change's concern)."""

from __future__ import annotations

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
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "gpt_neox": ("GPTNeoXConfig", dict(num_key_value_heads=None)),
    "olmo2": ("Olmo2Config", {}),
}
EAGER_ONLY = {"gemma2"}  # transformers has no SDPA kernel for Gemma 2 (attention soft-capping)


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
