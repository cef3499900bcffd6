"""ModelProfile: the formulas (analytic) against hand computation and against the measuring profiler."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from dtorch.errors import ConfigError
from dtorch.model import profile
from dtorch.model.profile import ModelProfile
from dtorch.model.profiler import profile_module
from dtorch.model.structure import find_blocks
from dtorch.models import build_from_config, model_config


def _measured(spec: str, seq_len: int, batch: int = 1) -> ModelProfile:
    cfg = model_config(spec)
    return profile_module(lambda: build_from_config(cfg), seq_len, batch=batch, name=spec)


def _assert_agree(measured: ModelProfile, analytic: ModelProfile, block_only: bool = False) -> None:
    assert measured.params_per_block == analytic.params_per_block
    assert measured.flops_per_token_block == pytest.approx(analytic.flops_per_token_block, rel=0.02)
    for ac in ("none", "selective", "full"):
        assert measured.act_bytes_per_token_block[ac] == pytest.approx(
            analytic.act_bytes_per_token_block[ac], rel=0.10), ac
    assert measured.tp_roles == analytic.tp_roles
    assert (measured.ops_per_block, measured.tensors_per_block) == (analytic.ops_per_block, analytic.tensors_per_block)
    assert (measured.hidden, measured.num_heads, measured.num_kv_heads, measured.ffn_hidden) == (
        analytic.hidden, analytic.num_heads, analytic.num_kv_heads, analytic.ffn_hidden)
    if not block_only:
        assert (measured.params_total, measured.params_embedding, measured.params_head) == (
            analytic.params_total, analytic.params_embedding, analytic.params_head)
        assert measured.num_layers == analytic.num_layers
        assert (measured.ops_head, measured.tensors_other) == (analytic.ops_head, analytic.tensors_other)
        assert measured.flops_per_token_head == pytest.approx(analytic.flops_per_token_head, rel=0.02)
        assert measured.act_bytes_per_token_head == pytest.approx(analytic.act_bytes_per_token_head, rel=0.10)


@pytest.mark.parametrize("spec", ["llama-tiny", "gpt-tiny"])
def test_analytic_profile_agrees_with_measured_profile_of_tiny_presets(spec):
    _assert_agree(_measured(spec, 64, batch=2), profile(spec, 64))


def test_analytic_profile_agrees_with_measured_llama3_8b_block_at_seq_2048():
    measured = _measured("llama3-8b:layers=1", 2048)
    analytic = profile("llama3-8b", 2048)
    _assert_agree(measured, analytic, block_only=True)
    # The head is the same module in the one-block copy.
    assert measured.flops_per_token_head == pytest.approx(analytic.flops_per_token_head, rel=0.02)
    assert measured.act_bytes_per_token_head == pytest.approx(analytic.act_bytes_per_token_head, rel=0.10)


def test_published_parameter_counts_analytic_and_measured_on_meta():
    assert profile("llama3-8b", 2048).params_total == pytest.approx(8.03e9, rel=0.01)
    assert profile("llama3-70b", 2048).params_total == pytest.approx(70.6e9, rel=0.01)
    assert profile("llama3-405b", 2048).params_total == pytest.approx(405.9e9, rel=0.01)
    measured = _measured("llama3-70b", 128)
    assert measured.params_total == profile("llama3-70b", 128).params_total
    assert measured.num_layers == 80


def test_llama_formulas_match_hand_computation():
    # h=8, a=2 (d=4), kv heads 1 (kv=4), f=16, V=10, s=4.
    p = profile("llama:layers=3,hidden=8,heads=2,kv_heads=1,ffn=16,vocab=10,seq=32", 4)
    matmul = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16  # wq, wk+wv, wo, w1/w2/w3 = 576
    assert p.params_per_block == matmul + 2 * 8
    assert p.params_embedding == 80 and p.params_head == 8 + 80
    assert p.params_total == 3 * 592 + 80 + 88
    assert p.flops_per_token_block == 6 * 576 + 12 * 8 * 4
    assert p.flops_per_token_head == 6 * 8 * 10
    assert p.flops_per_token == 3 * 3840 + 480
    # none: x, normed, q, k, v, out, h, normed (bf16) + 4 x f (SwiGLU) + lse 4/head + 2 rstd.
    assert p.act_bytes_per_token_block == {"none": 2 * (8 + 8 + 8 + 4 + 4 + 8 + 8 + 8 + 4 * 16) + 8 + 8,
                                           "selective": 2 * (8 + 8 + 4 + 4 + 8 + 8 + 16 + 16 + 8) + 8,
                                           "full": 16.0}
    # final norm's input + rstd, output projection's input, the loss's 16-bit logits, token ids + targets
    # (int64) and the loss's float32 log-sum-exp
    assert p.act_bytes_per_token_head == 2 * 8 + 4 + 2 * 8 + 2 * 10 + 8 + 8 + 4


def test_gpt_flops_equal_megatrons_formula_for_the_22b_model():
    # Korthikanti et al. 22B: l=48, h=6144, a=64, s=2048, V=51200. Megatron's model FLOPs per token:
    # 72*l*h^2*(1 + s/(6h) + V/(12*l*h)); it counts attention over the full s^2, as we do.
    n, h, s, V = 48, 6144, 2048, 51200
    p = profile(f"gpt:layers={n},hidden={h},heads=64,vocab={V},seq={s}", s)
    assert p.flops_per_token == pytest.approx(72 * n * h * h * (1 + s / (6 * h) + V / (12 * n * h)), rel=1e-12)


def test_gpt_activation_bytes_are_korthikanti_without_the_s_squared_term():
    # With dropout, Table 2 "no parallelism" is 34*h + 5*a*s bytes per token per layer. Fused
    # attention removes 5*a*s and keeps a float32 log-sum-exp per head; LayerNorms keep stats.
    h, a, s = 6144, 64, 2048
    p = profile(f"gpt:layers=2,hidden={h},heads={a},seq={s},dropout=0.1", s)
    assert p.act_bytes_per_token_block["none"] == 34 * h + 4 * a + 16
    assert profile(f"gpt:layers=2,hidden={h},heads={a},seq={s}", s).act_bytes_per_token_block["none"] == (
        32 * h + 4 * a + 16)


def test_attention_flops_grow_linearly_with_sequence_length():
    short, long = profile("llama3-8b", 1024), profile("llama3-8b", 4096)
    assert long.flops_per_token_block - short.flops_per_token_block == 12 * 4096 * (4096 - 1024)
    assert long.params_total == short.params_total


def test_gpt_sequence_longer_than_its_positions_is_a_config_error():
    with pytest.raises(ConfigError, match="seq_len"):
        profile("gpt2-small", 2048)
    assert profile("gpt2-small:seq=2048", 2048).seq_len == 2048


def test_profile_round_trips_through_json():
    p = profile("llama-tiny", 64)
    assert ModelProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_profile_of_presets_does_not_import_torch():
    code = ("import sys; from dtorch.model import profile; p = profile('llama3-70b', 8192); "
            "assert p.params_total > 7e10; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("spec", ["llama9-1t", "no_such_pkg.mod:build", "dtorch.models:nothing_here",
                                  "/nonexistent/config.json", "just words"])
def test_unknown_model_spec_is_a_config_error_naming_the_valid_forms(spec):
    with pytest.raises(ConfigError) as err:
        profile(spec, 128)
    assert err.value.field == "model"


def test_factory_spec_is_measured_by_the_profiler(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(textwrap.dedent("""
        from dtorch.models import build_model
        def tiny():
            return build_model("llama-tiny:layers=3")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    p = profile("my_models:tiny", 64)
    assert p.source == "measured" and p.num_layers == 3
    assert p.params_total == profile("llama-tiny:layers=3", 64).params_total


class _MHABlock(nn.Module):
    """A block whose attention is nn.MultiheadAttention (fused in_proj parameter, no Linear pair)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)

    def forward(self, x):
        y = self.norm(x)
        return x + self.attn(y, y, y, need_weights=False)[0]


class _CustomLM(nn.Module):
    def __init__(self, dim: int = 32, vocab: int = 50, layers: int = 3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_MHABlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.emb(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_custom_module_without_linear_pairs_has_empty_roles_and_a_reason():
    p = profile_module(_CustomLM(), 16)
    assert p.family == "custom" and p.num_layers == 3 and p.block_path == "blocks"
    assert p.params_total == sum(q.numel() for q in _CustomLM().parameters())
    assert p.tp_roles == {}
    assert "column->row" in p.tp_roles_reason and "MultiheadAttention" in p.tp_roles_reason
    assert p.flops_per_token_block > 0 and p.act_bytes_per_token_block["none"] > p.act_bytes_per_token_block["full"]


def test_find_blocks_picks_the_largest_container_of_identical_children():
    model = _CustomLM(layers=5)
    model.extra = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    path, container = find_blocks(model)
    assert path == "blocks" and len(container) == 5
    # no repeated blocks: the whole model is one unit (docs/models.md)
    path, container = find_blocks(nn.Sequential(nn.Linear(2, 2)))
    assert path == "" and len(container) == 0


def test_hugging_face_llama_config_is_measured_like_the_reference_model(tmp_path):
    pytest.importorskip("transformers")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "vocab_size": 256, "max_position_embeddings": 256, "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    p = profile(str(path), 64)
    ref = profile("llama-tiny:layers=2", 64)
    assert (p.params_total, p.params_per_block, p.params_embedding) == (
        ref.params_total, ref.params_per_block, ref.params_embedding)
    assert p.flops_per_token_block == pytest.approx(ref.flops_per_token_block, rel=0.02)
    assert p.block_path == "model.layers"
    assert {k: v for k, v in p.tp_roles.items() if v in ("colwise", "rowwise")} == {
        "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise"}
    assert p.tp_roles["lm_head"] == "output" and p.tp_roles["model.embed_tokens"] == "embedding"


def test_selective_policy_ops_work_as_a_must_save_checkpoint_policy():
    """The executor applies selective AC with SELECTIVE_SAVE_OPS as MUST_SAVE; the gradients stay exact."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from dtorch.model.profiler import SELECTIVE_SAVE_OPS

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in SELECTIVE_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    model = build_from_config(model_config("llama-tiny:layers=1"))
    block = model.layers["0"]
    x = torch.randn(2, 16, 64, requires_grad=True)
    cos, sin = model.rope_cos[:16], model.rope_sin[:16]
    block(x, cos, sin).square().sum().backward()
    expected = x.grad.clone()
    x.grad = None
    out = checkpoint(block, x, cos, sin, use_reentrant=False,
                     context_fn=partial(create_selective_checkpoint_contexts, policy))
    out.square().sum().backward()
    torch.testing.assert_close(x.grad, expected)
