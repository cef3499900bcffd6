"""Model profiles for the planner: `get_profile(spec, seq_len)` (the model room's `profile`, torch-free
for presets and specs) is what the CLI and the recommender call. `analytic_profile(...)` builds a
ModelProfile from hyper-parameters alone for the published shapes the calibration uses (Megatron
GPT without flash attention, MPT), which are not reference models.

Analytic conventions (documented so that the calibrated efficiencies mean something):
- FLOPs per token per block = 6 x matmul parameters + 12 h s (torchtitan; full s^2 attention);
  head = 6 V h (the output projection; the embedding lookup is free).
- Activation bytes per token per block, 16-bit:
  * GPT without flash attention: Korthikanti et al. 2022 Table 2, none 34h + 5as, selective 34h,
    full 2h (input of the block only).
  * flash attention (Llama, or GPT with flash=True): no s^2 term. Llama SwiGLU/GQA counted tensor by
    tensor: norm inputs 2h+2h, norm outputs 2h+2h, q,k,v 2h+4h_kv, attention output 2h,
    w1/w3 outputs, SiLU output and product 4 x 2f  -> 12h + 4h_kv + 8f. Selective recomputes the norm
    outputs and the SwiGLU element-wise products: 8h + 4h_kv + 4f. Full keeps the block input 2h.
- Head activations per token: final-norm input/output 4h + the 16-bit logits the loss keeps 2V
  (`dtorch.model.loss`; its backward's working set is the memory model's, `loss_working_set`).
"""

from __future__ import annotations

from typing import Any

from dtorch.errors import ConfigError
from dtorch.model.profile import ModelProfile


def analytic_profile(
    name: str,
    family: str,
    *,
    layers: int,
    hidden: int,
    heads: int,
    seq_len: int,
    vocab: int,
    kv_heads: int | None = None,
    ffn: int | None = None,
    tied: bool = False,
    flash: bool | None = None,
    biases: bool | None = None,
) -> ModelProfile:
    """A ModelProfile from hyper-parameters (see module doc for every count)."""
    kv_heads = kv_heads or heads
    kv_dim = hidden * kv_heads // heads
    h, s, V = hidden, seq_len, vocab
    if family == "llama":
        ffn = ffn or 256 * ((int(8 * h / 3) + 255) // 256)
        mm = 2 * h * h + 2 * h * kv_dim + 3 * h * ffn
        block = mm + 2 * h
        flash = True if flash is None else flash
        acts = {"none": 12.0 * h + 4.0 * kv_dim + 8.0 * ffn,
                "selective": 8.0 * h + 4.0 * kv_dim + 4.0 * ffn,
                "full": 2.0 * h}
        emb = V * h
    else:
        ffn = ffn or 4 * h
        biases = True if biases is None else biases
        mm = 4 * h * h + 2 * h * ffn
        block = mm + 4 * h + ((4 * h + ffn + h) if biases else 0)
        flash = False if flash is None else flash
        a_s = 0.0 if flash else 5.0 * heads * s
        acts = {"none": 34.0 * h + a_s, "selective": 34.0 * h, "full": 2.0 * h}
        emb = V * h + (s * h if family == "gpt" else 0)
    head_params = (0 if tied else V * h) + 2 * h
    return ModelProfile(
        name=name,
        family=family,
        num_layers=layers,
        hidden=h,
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden=ffn,
        vocab_size=V,
        seq_len=s,
        params_total=layers * block + emb + head_params,
        params_per_block=block,
        params_embedding=emb,
        params_head=head_params,
        flops_per_token_block=6.0 * mm + 12.0 * h * s,
        flops_per_token_head=6.0 * V * h,
        act_bytes_per_token_block=acts,
        act_bytes_per_token_head=4.0 * h + 2.0 * V,
        tp_roles={},
        tied_embeddings=tied,
        unfused_attention=not flash,
    )


def get_profile(spec: str, seq_len: int, fused_attention: bool = False) -> ModelProfile:
    """The profile of a model spec (preset, ``llama:...``/``gpt:...``, or anything the model room
    accepts) at `seq_len` tokens. Never imports torch for presets and hyper-parameter specs.
    `fused_attention`: a measured model's attention as a GPU runs it (`for_devices`)."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError("seq_len", seq_len, "must be a positive integer")
    from dtorch.model import profile

    return profile(spec, seq_len, fused_attention)


def gpu_attention_differs(profile: ModelProfile, groups: Any) -> bool:
    """Whether the devices of node `groups` (a cluster's) run `profile`'s attention otherwise than
    it was measured: it was measured with attention dropout on a CPU (the math kernel's s x s
    scores) and the groups have GPUs, whose fused kernels keep none."""
    return profile.attention_dropout and any(g.device.kind != "cpu" for g in groups)


def for_devices(profile: ModelProfile, spec: str, seq_len: int, groups: Any) -> ModelProfile:
    """`profile` (of `spec` at `seq_len`) as the devices of node `groups` run the model: measured
    again with a GPU's attention where `gpu_attention_differs`; else `profile` itself."""
    return get_profile(spec, seq_len, fused_attention=True) if gpu_attention_differs(profile, groups) else profile
