"""ModelProfile from hyper-parameters alone, by formula. Torch-free and instant (the planner's path).

Notation (all per token, per block unless said): h = dim, a = query heads, d = head_dim, q = a*d
(query width, = h for every preset), kv = kv_heads*d, f = MLP hidden width, V = vocab, S =
max_seq_len (GPT positions), s = the profile's sequence length. The formulas describe exactly
the reference modules in `dtorch.models` and are checked against the measuring profiler
(`dtorch.model.profiler`) in tests/model.

Parameters
  Llama block  h*q + 2*h*kv + q*h + 3*h*f  (wq, wk, wv, wo, SwiGLU w1/w2/w3)  + 2h (two RMSNorms)
  GPT block    4*h^2 + 4h (q,k,v,o + biases) + 2*h*f + f + h (MLP + biases) + 4h (two LayerNorms)
  embedding    V*h (+ S*h learned positions for GPT);  head  h*V + norm (h Llama, 2h GPT); untied.

Training FLOPs per token (convention "6N+12lhs", the one torchtitan uses to report MFU, and the
one the MFU figures in /work/shared/reference/CALIBRATION.md were computed with; checked: Llama
3.1 8B at seq 8192 and 5,762 tok/s/GPU gives 33.8% of 989 TFLOP/s, the quoted "33%"):
  block  6 * (matmul params of the block) + 12 * q * s    (attention QK^T and PV, forward 4*q*s,
         backward twice that, over the FULL s x s score matrix: the causal mask is NOT halved,
         unlike Megatron's convention; torch's FlopCounterMode counts SDPA the same way)
  head   6 * h * V  (output projection; embedding lookups are not FLOPs)
Recomputation (activation checkpointing) is not included: these are "model FLOPs".

Activation bytes kept for backward, per token per block, 16-bit activations, batch- and
TP-independent (the cost model divides by tp where TP/SP shards them). Korthikanti et al. 2022
Table 2 give 34*h + 5*a*s bytes for a GPT block without recompute; we adjust it for how the
reference models run today:
  - fused attention (flash / SDPA): the a*s^2 score, softmax and dropout-mask terms vanish;
    the kernel keeps q, k, v, the output (2q, shared with wo's input) and a float32
    log-sum-exp per head (4a);
  - no dropout masks when dropout p = 0 (the default; with p > 0 a GPT block adds 2h bytes of
    bool masks for the two residual dropouts);
  - GQA: k and v are kv wide, not h (the kernel broadcasts them, `enable_gqa`);
  - SwiGLU keeps w1 out, w3 out, silu out and their product: 4 tensors of f (GPT's GeLU: 2);
  - norms keep their input (2h) and float32 statistics (RMSNorm rstd 4 B; LayerNorm mean+rstd 8 B),
    as the fused CUDA kernels do.
  none       Llama  2*(4h + 2q + 2kv + 4f) + 4a + 8      GPT  2*(8h + 2f) + 4a + 16 (= 32h + 4a + 16
             for f = 4h: Korthikanti's 34h minus the two dropout masks, no s^2 term)
  selective  op-level policy: keep the outputs of matmuls and of attention, recompute the rest
             (norms, RoPE, activations); plus the block input:
             Llama  2*(3h + 2q + 2kv + 2f) + 4a          GPT  2*(7h + f) + 4a
  full       the block input only: 2h
Head (embedding + final norm + output + loss): 2h norm input + stats, 2h output-projection input,
2V logits kept by the loss (`dtorch.model.loss`: the softmax is recomputed in float32 chunks in its
backward), 20 B of token ids and targets (int64) and the loss's float32 log-sum-exp.
"""

from __future__ import annotations

from dtorch.errors import ConfigError
from dtorch.model.profile import ModelProfile
from dtorch.models.configs import GPTConfig, LlamaConfig, ModelConfig, MoEConfig

ACT_BYTES = 2
"""Bytes per activation element: profiles are stated at 16-bit activations."""

LLAMA_BLOCK_ROLES = {
    "attention_norm": "norm", "attention": "attention",
    "attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise", "attention.wo": "rowwise",
    "ffn_norm": "norm",
    "feed_forward.w1": "colwise", "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise",
}
GPT_BLOCK_ROLES = {k: v for k, v in LLAMA_BLOCK_ROLES.items() if k != "feed_forward.w3"}
TOP_ROLES = {"tok_embeddings": "embedding", "norm": "norm", "output": "output"}


def block_matmul_params(config: ModelConfig) -> int:
    """Weights of the block's linear layers (the N of 6N), biases and norms excluded."""
    h, q, kv, f = config.dim, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.ffn_hidden
    mlp = 3 * h * f if isinstance(config, LlamaConfig) else 2 * h * f
    return h * q + 2 * h * kv + q * h + mlp


def block_params(config: ModelConfig) -> int:
    """All parameters of one block (see the module docstring)."""
    h, f = config.dim, config.ffn_hidden
    if isinstance(config, LlamaConfig):
        return block_matmul_params(config) + 2 * h
    return block_matmul_params(config) + 4 * h + f + h + 4 * h


def block_act_bytes(config: ModelConfig) -> dict[str, float]:
    """Activation bytes per token per block by AC policy (16-bit; see the module docstring)."""
    h, a, f = config.dim, config.n_heads, config.ffn_hidden
    q, kv = a * config.head_dim, config.n_kv_heads * config.head_dim
    lse = 4 * a
    if isinstance(config, LlamaConfig):
        none = ACT_BYTES * (4 * h + 2 * q + 2 * kv + 4 * f) + lse + 2 * 4
        selective = ACT_BYTES * (3 * h + 2 * q + 2 * kv + 2 * f) + lse
    else:
        none = ACT_BYTES * (8 * h + 2 * f) + lse + 2 * 8 + (2 * h if config.dropout > 0 else 0)
        selective = ACT_BYTES * (7 * h + f) + lse
    return {"none": float(none), "selective": float(selective), "full": float(ACT_BYTES * h)}


def head_act_bytes(config: ModelConfig) -> float:
    """Activation bytes per token of embedding, final norm, output projection and cross-entropy."""
    stats = 4 if isinstance(config, LlamaConfig) else 8
    return float(ACT_BYTES * 2 * config.dim + stats + ACT_BYTES * config.vocab_size + 20)


LOSS_CHUNK_ELEMENTS = 2**23
"""Float32 elements of logits the loss (`dtorch.model.loss`) upcasts at a time: 32 MiB."""


def loss_chunk_rows(classes: int) -> int:
    """Rows of logits per chunk of the loss over `classes` (at least one)."""
    return max(1, LOSS_CHUNK_ELEMENTS // max(1, classes))


# Forward operators of one block and of the rest (embeddings, final norm, output, loss) as the
# profiler counts them (aten ops under FakeTensorMode, tests/model/test_profile.py pins the agreement).
OPS_PER_BLOCK = {"llama": 93, "gpt": 38}
OPS_HEAD = {"llama": 37, "gpt": 30}


def block_param_tensors(config: ModelConfig) -> int:
    """Parameter tensors of one block: Llama q, k, v, o, w1, w2, w3 and two norms; GPT q, k, v, o and
    the MLP's two linears with biases, and two layer norms with weight and bias."""
    return 9 if isinstance(config, LlamaConfig) else 16


def profile_from_config(config: ModelConfig, seq_len: int, name: str | None = None) -> ModelProfile:
    """The profile of a reference model at `seq_len` tokens per sequence, by formula (no torch).

    Raises ConfigError when seq_len is not positive or exceeds a GPT's learned positions."""
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ConfigError("seq_len", seq_len, "must be a positive integer (tokens per sequence)")
    if isinstance(config, MoEConfig):
        return moe_profile_from_config(config, seq_len, name)
    is_llama = isinstance(config, LlamaConfig)
    assert is_llama or isinstance(config, GPTConfig), type(config)
    if not is_llama and seq_len > config.max_seq_len:
        raise ConfigError("seq_len", seq_len, f"this GPT has {config.max_seq_len} learned positions; use "
                          f"seq_len <= {config.max_seq_len} or a model spec with seq={seq_len}")
    h, V = config.dim, config.vocab_size
    q = config.n_heads * config.head_dim
    per_block = block_params(config)
    embedding = V * h + (0 if is_llama else config.max_seq_len * h)
    head = h * V + (h if is_llama else 2 * h)
    top_roles = dict(TOP_ROLES) if is_llama else {**TOP_ROLES, "pos_embeddings": "embedding"}
    return ModelProfile(
        name=name or config.family,
        family=config.family,
        num_layers=config.n_layers,
        hidden=h,
        num_heads=config.n_heads,
        num_kv_heads=config.n_kv_heads,
        ffn_hidden=config.ffn_hidden,
        vocab_size=V,
        seq_len=seq_len,
        params_total=config.n_layers * per_block + embedding + head,
        params_per_block=per_block,
        params_embedding=embedding,
        params_head=head,
        flops_per_token_block=float(6 * block_matmul_params(config) + 12 * q * seq_len),
        flops_per_token_head=float(6 * h * V),
        act_bytes_per_token_block=block_act_bytes(config),
        act_bytes_per_token_head=head_act_bytes(config),
        tp_roles={**(LLAMA_BLOCK_ROLES if is_llama else GPT_BLOCK_ROLES), **top_roles},
        tied_embeddings=False,
        block_path="layers",
        source="analytic",
        max_seq_len=config.max_seq_len,
        ops_per_block=OPS_PER_BLOCK[config.family],
        ops_head=OPS_HEAD[config.family],
        tensors_per_block=block_param_tensors(config),
        tensors_other=3 if is_llama else 5,
    )


# ---- mixtures of experts (dtorch.models.moe) ---------------------------------------------------
# Notation as above, plus E routed experts, k per token, fe one expert's hidden width, fs = shared
# experts * fe, f the dense blocks' width. MLA: H heads, ql/kvl the query/latent ranks, qk =
# nope + rope per-head query/key width, v the value width (padded to qk for the fused kernel).
#
# Parameters      MoE block = attention + 2h (norms) + h*E (router) + E*3*h*fe + 3*h*fs
#                 dense block = attention + 2h + 3*h*f;  active = total - moe_layers*(E-k)*3*h*fe
#   GQA attention h*q + 2*h*kv + q*h (+ 2d per-head q/k norms)
#   MLA attention [h*ql + ql + ql*H*qk | h*H*qk] + h*(kvl+rope) + kvl + kvl*H*(nope+v) + H*v*h
# FLOPs per token 6 * (matmul params a token passes through: attention, router, its k experts,
#                 shared experts) + attention core 12*H*d*s (GQA d = head_dim; MLA d = qk, since
#                 the values are padded to it).
# Activation bytes (16-bit, fused norms, dropless, `none` policy) beyond the block's 4 norm
#   inputs/outputs (2*4h + 8):
#   GQA attention 2*(2q + 2kv) + 4a (+ qk-norm inputs 2q + 2kv and stats 4a + 4*kv_heads)
#   MLA attention 2*(kvl+rope) + 4 + 2*kvl + 8*H*qk (q, k, padded v and output) + 4H + 2*H*v
#                 (+ 4*ql + 4 for the query bottleneck)
#   router        4E (float32 scores) + 8k (indices) (+ 4 + 4k when the top-k weights are
#                 renormalised)
#   per assignment 6h (the gathered token, the expert output, the weighted output) + 8*fe (SwiGLU)
#                 + 18 (two int64 indices, the bf16 gate weight)
#   shared        8*fs;   balance loss  4E/s (per-sequence counts) (+ 4 with sigmoid scores)
#   selective     the block input, matmul and attention outputs: 2h + attention + 2E + k*(4fe + 2h)
#                 (+ 4fs + 2h shared).
# Operators per MoE block (eager, one forward; measured and pinned by tests/model): a fixed part
# plus 11 per routed expert (the per-expert slice, three linears, silu, product, bookkeeping).


def _moe_attention(c: MoEConfig) -> dict[str, int | float]:
    """Parameters, matmul parameters, core-attention width and activation bytes of one attention."""
    h, H = c.dim, c.n_heads
    if c.attention == "gqa":
        q, kv = H * c.head_dim, c.n_kv_heads * c.head_dim
        matmul = h * q + 2 * h * kv + q * h
        norms = 2 * c.head_dim if c.qk_norm else 0
        none = ACT_BYTES * (2 * q + 2 * kv) + 4 * H
        if c.qk_norm:
            none += ACT_BYTES * (q + kv) + 4 * H + 4 * c.n_kv_heads
        selective = ACT_BYTES * (2 * h + 2 * q + 2 * kv) + 4 * H
        return dict(params=matmul + norms, matmul=matmul, core=H * c.head_dim, none=none, selective=selective)
    qk, ql, kvl, rope = c.qk_nope_head_dim + c.qk_rope_head_dim, c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim
    q_proj = h * ql + ql * H * qk if ql else h * H * qk
    matmul = q_proj + h * (kvl + rope) + kvl * H * (c.qk_nope_head_dim + c.v_head_dim) + H * c.v_head_dim * h
    none = (ACT_BYTES * (kvl + rope + kvl + 4 * H * qk + H * c.v_head_dim) + 4 + 4 * H
            + (2 * ACT_BYTES * ql + 4 if ql else 0))
    selective = (ACT_BYTES * (2 * h + (ql if ql else 0) + H * qk + kvl + rope
                              + H * (c.qk_nope_head_dim + c.v_head_dim) + H * qk) + 4 * H)
    return dict(params=matmul + (ql if ql else 0) + kvl, matmul=matmul, core=H * qk, none=none, selective=selective)


def moe_ops_per_block(c: MoEConfig) -> int:
    """Forward aten operators of one MoE block (see above; pinned against the profiler in tests)."""
    ops = 105 + 11 * c.n_experts
    ops += 3 if c.norm_topk_prob and c.top_k > 1 else 0
    ops += 9 if c.n_shared_experts else 0
    ops += (13 + (2 if c.score_func == "sigmoid" else 0)) if c.aux_loss_coef > 0 else 0
    ops += 2 if c.bias_update_speed > 0 else 0
    ops += 10 if c.n_expert_groups > 1 else 0
    if c.attention == "gqa":
        ops += 18 if c.qk_norm else 0
    else:
        ops += 18
        ops += 13 if c.q_lora_rank else 0
    return ops


def moe_profile_from_config(c: MoEConfig, seq_len: int, name: str | None = None) -> ModelProfile:
    """The profile of a dtorch.models.moe model at `seq_len`: the *_block fields describe a MoE block,
    the *_dense_block fields the leading dense blocks; FLOPs count the active experts only."""
    h, V, E, k, fe = c.dim, c.vocab_size, c.n_experts, c.top_k, c.expert_hidden
    fs = c.n_shared_experts * fe
    att = _moe_attention(c)
    per_expert = 3 * h * fe
    moe_block = att["params"] + 2 * h + h * E + E * per_expert + 3 * h * fs
    dense_block = att["params"] + 2 * h + 3 * h * c.ffn_hidden
    embedding, head = V * h, h * V + h
    total = c.n_moe_layers * moe_block + c.n_dense_layers * dense_block + embedding + head
    core_flops = 12 * att["core"] * seq_len
    renorm = c.norm_topk_prob and k > 1
    none = (ACT_BYTES * 4 * h + 8 + att["none"] + 4 * E + 8 * k + (4 + 4 * k if renorm else 0)
            + k * (3 * ACT_BYTES * h + 4 * ACT_BYTES * fe + 18) + 4 * ACT_BYTES * fs
            + ((4 * E / seq_len + (4 if c.score_func == "sigmoid" else 0)) if c.aux_loss_coef > 0 else 0))
    selective = (att["selective"] + ACT_BYTES * E + k * ACT_BYTES * (2 * fe + h)
                 + (ACT_BYTES * (2 * fs + h) if fs else 0))
    roles: dict[str, str] = {}
    if c.attention == "gqa":
        roles.update({"attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise",
                      "attention.wo": "rowwise", "attention": "attention"})
    if fs:
        roles.update({"feed_forward.shared_expert.w1": "colwise", "feed_forward.shared_expert.w3": "colwise",
                      "feed_forward.shared_expert.w2": "rowwise"})
    if roles:
        norms = ["attention_norm", "ffn_norm"]
        norms += (["attention.q_norm", "attention.k_norm"] if c.attention == "gqa" and c.qk_norm else [])
        norms += (["attention.q_norm"] if c.attention == "mla" and c.q_lora_rank else [])
        norms += (["attention.kv_norm"] if c.attention == "mla" else [])
        roles.update({n: "norm" for n in norms})
        roles.update(TOP_ROLES)
    if c.attention == "gqa":
        tensors = 4 + (2 if c.qk_norm else 0)
    else:
        tensors = (3 if c.q_lora_rank else 1) + 4
    tensors += 2 + 1 + 3 + (3 if fs else 0)
    return ModelProfile(
        name=name or c.family,
        family=c.family,
        num_layers=c.n_layers,
        hidden=h,
        num_heads=c.n_heads,
        num_kv_heads=c.n_kv_heads if c.attention == "gqa" else c.n_heads,
        ffn_hidden=c.ffn_hidden,
        vocab_size=V,
        seq_len=seq_len,
        params_total=total,
        params_per_block=moe_block,
        params_embedding=embedding,
        params_head=head,
        flops_per_token_block=float(6 * (att["matmul"] + h * E + k * per_expert + 3 * h * fs) + core_flops),
        flops_per_token_head=float(6 * h * V),
        act_bytes_per_token_block={"none": float(none), "selective": float(selective), "full": float(ACT_BYTES * h)},
        act_bytes_per_token_head=float(ACT_BYTES * 2 * h + 4 + ACT_BYTES * V + 20),
        tp_roles=roles,
        tp_roles_reason="" if roles else "MLA attention without shared experts: no column->row pair derived",
        tied_embeddings=False,
        block_path="layers",
        source="analytic",
        max_seq_len=c.max_seq_len,
        ops_per_block=moe_ops_per_block(c),
        ops_head=OPS_HEAD["llama"],
        tensors_per_block=tensors,
        tensors_other=3,
        num_experts=E,
        experts_per_token=k,
        num_shared_experts=c.n_shared_experts,
        expert_hidden=fe,
        params_per_expert=per_expert,
        num_dense_layers=c.n_dense_layers,
        params_per_dense_block=dense_block if c.n_dense_layers else 0,
        flops_per_token_dense_block=(float(6 * (att["matmul"] + 3 * h * c.ffn_hidden) + core_flops)
                                     if c.n_dense_layers else 0.0),
        params_active=total - c.n_moe_layers * (E - k) * per_expert,
    )
