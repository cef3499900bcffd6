"""What a measured profile counts as saved activations, against what a real CPU run saves for
backward (saved-tensor hooks).

The whole model: the blocks' figure times their number plus the head's equals the real run's total,
also for a chain of blocks that each keep their own output (a ReLU at the end) and their input (a
convolution first), where one block measured for all would count each block's output twice.

The float32 share: of its 16-bit activation figures, the bytes a model keeps in float32
whatever its compute dtype (an explicit upcast, a math attention kernel's scores and softmax), so
that the figure at another compute dtype is that share plus the rest scaled. Checked against what
a real float32 CPU run of the same block saves for backward (saved-tensor hooks), on a
hand-written block whose norm upcasts (its own names), on one that keeps nothing in float32, and on
transformers' Llama (whose RMSNorm upcasts: measured as it runs, `composite_norms_measured`).
In-process; a few seconds."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from dtorch.model import profile_module
from dtorch.model.tp_rules import halve_linears
from dtorch.plan.strategies.memory import tp_split_bytes

SEQ, BATCH = 32, 2


class TokenModel(nn.Module):
    """A user's language model around `block()`: an embedding of 64 tokens into `d`, two blocks in
    `layers`, a linear head."""

    def __init__(self, block, d: int):
        super().__init__()
        self.emb, self.out = nn.Embedding(64, d), nn.Linear(d, 64)
        self.layers = nn.ModuleList(block() for _ in range(2))

    def forward(self, t):
        h = self.emb(t)
        for b in self.layers:
            h = b(h)
        return self.out(h)


class UpcastNorm(nn.Module):
    """A user's RMS norm in the transformers style: statistics in float32, result cast back."""

    def __init__(self, dim: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        wide = x.to(torch.float32)
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.gain * wide.to(x.dtype)


class Mixer(nn.Module):
    def __init__(self, dim: int, norm: bool):
        super().__init__()
        self.pre = UpcastNorm(dim) if norm else nn.Identity()
        self.inp = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.out(F.gelu(self.inp(self.pre(x))))


class Net(nn.Module):
    def __init__(self, norm: bool, dim: int = 32, depth: int = 3, vocab: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.stack = nn.ModuleList(Mixer(dim, norm) for _ in range(depth))
        self.proj = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.emb(tokens)
        for m in self.stack:
            h = m(h)
        return self.proj(h)


def _real_block_bytes(model: nn.Module, block: nn.Module, dtype: torch.dtype) -> float:
    """Bytes per token block `block` of `model` saves for backward in a real CPU run at `dtype`."""
    from dtorch.model.hf import adapt

    torch.manual_seed(0)
    model = adapt(model).to(dtype).train()
    block = block(model)  # (before the parameters are listed: it may replace some)
    excluded = {StorageWeakRef(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
    inside, seen = [False], {}
    block.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
    block.register_forward_hook(lambda *a: inside.__setitem__(0, False))

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if inside[0] and ref not in excluded:
            seen.setdefault(ref, t.untyped_storage().nbytes())
        return t

    tokens = torch.randint(0, 64, (BATCH, SEQ))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return sum(seen.values()) / (BATCH * SEQ)


def _at_float32(p) -> float:
    a16, f32 = p.act_bytes_per_token_block["none"], p.act_bytes_float32_per_token_block["none"]
    return f32 + 2.0 * (a16 - f32)


def test_an_upcasting_norm_is_the_float32_share_and_the_rest_scales():
    p = profile_module(lambda: Net(norm=True), SEQ, BATCH)
    # the norm's float32 input copy (4 B per feature) and its float32 statistics (4 B per token)
    assert p.act_bytes_float32_per_token_block["none"] >= 4 * 32 + 4
    real = _real_block_bytes(Net(norm=True), lambda m: m.stack[0], torch.float32)
    assert _at_float32(p) == pytest.approx(real, rel=1e-6)
    assert 2.0 * p.act_bytes_per_token_block["none"] > 1.1 * real  # doubling the whole would be wrong
    assert _real_block_bytes(Net(norm=True), lambda m: m.stack[0], torch.bfloat16) == pytest.approx(
        p.act_bytes_per_token_block["none"], rel=1e-6)
    assert not p.composite_norms_measured  # (a norm not named *RMSNorm: nothing for the cost model to add)


def test_a_block_without_float32_tensors_has_no_float32_share():
    p = profile_module(lambda: Net(norm=False), SEQ, BATCH)
    assert p.act_bytes_float32_per_token_block == {"none": 0.0, "selective": 0.0, "full": 0.0}
    assert _at_float32(p) == pytest.approx(_real_block_bytes(Net(norm=False), lambda m: m.stack[0], torch.float32))


def test_profiling_at_float32_reports_no_share():
    p = profile_module(lambda: Net(norm=True), SEQ, BATCH, dtype=torch.float32)
    assert p.act_bytes_float32_per_token_block == {} and p.act_bytes_float32_per_token_head == 0.0


def test_transformers_llama_rmsnorm_upcast_is_measured_as_it_runs():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)

    def factory():
        return transformers.LlamaForCausalLM(cfg)

    p = profile_module(factory, SEQ, BATCH)
    assert p.composite_norms_measured
    real = _real_block_bytes(factory(), lambda m: m.layers["0"], torch.float32)
    # (the profile's block also holds the rotary cos/sin the first block is the first to save: 2 x
    # head_dim at 16 bits, which the real float32 run keeps as 2 x head_dim at 32)
    assert _at_float32(p) == pytest.approx(real, abs=2 * 2 * 8 + 1)
    assert abs(2.0 * p.act_bytes_per_token_block["none"] - real) > 0.1 * real


def test_an_nn_rmsnorm_is_counted_as_the_fused_kernel():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(32)
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            return x + self.fc(self.norm(x))

    assert not profile_module(lambda: TokenModel(Block, 32), SEQ, BATCH).composite_norms_measured


class ConvReLU(nn.Module):
    """A block that keeps its input (the convolution) and its own output (the ReLU)."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return F.relu(self.conv(x))


class Residual(nn.Module):
    """A block that keeps its input but not its output (a residual add)."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv(F.relu(x))


class Tower(nn.Module):
    def __init__(self, block: type, depth: int = 3, c: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.body = nn.ModuleList(block(c) for _ in range(depth))
        self.classify = nn.Linear(c, 5)

    def forward(self, x):
        x = self.stem(x)
        for b in self.body:
            x = b(x)
        return self.classify(x.mean((2, 3)))


def _real_total(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    excluded = {StorageWeakRef(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
    seen = {}

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in excluded:
            seen.setdefault(ref, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(x), y)
    return sum(seen.values())


@pytest.mark.parametrize("block", [ConvReLU, Residual])
@pytest.mark.parametrize("depth", [2, 3])
def test_blocks_times_their_number_plus_the_head_is_what_a_real_run_saves(block, depth):
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 5, (4,))
    p = profile_module(lambda: Tower(block, depth), SEQ, sample=(x, y), loss=F.cross_entropy, dtype=torch.float32)
    total = p.num_layers * p.act_bytes_per_token_block["none"] + p.act_bytes_per_token_head
    assert total * len(x) == _real_total(Tower(block, depth), x, y)
    # every block keeps (at least) its input: a feature map of 4 x 6 x 6 float32 per sample
    assert p.act_bytes_per_token_block["none"] >= p.act_bytes_per_token_block["full"] == 4 * 6 * 6 * 4


# ---- what tensor parallelism splits: measured as a TP rank runs the block --------------------------
def test_the_measured_tp_split_of_dtorch_llama_is_the_analytic_one():
    """DTorch's Llama measured: the split bytes equal the cost model's count tensor by tensor
    (`memory.tp_split_bytes`: q, k, v, the attention output and statistics, SwiGLU's f-wide tensors)."""
    from dtorch.models import build_model

    spec = "llama-tiny:layers=2,hidden=64,heads=4,kv_heads=2"
    p = profile_module(lambda: build_model(spec), SEQ, BATCH)
    assert p.act_bytes_tp_split_per_token_block["full"] == 0.0
    for ac in ("none", "selective"):
        # (the formula: a measured profile's own split is what `tp_split_bytes` returns for it)
        formula = tp_split_bytes(dataclasses.replace(p, source="analytic"), ac)
        assert p.act_bytes_tp_split_per_token_block[ac] == pytest.approx(formula), ac
        assert 0 < p.act_bytes_tp_split_per_token_block[ac] < p.act_bytes_per_token_block[ac]


def test_gpt2_tp_split_holds_its_attention_scores_and_gelu_intermediates():
    """transformers' GPT-2 with attention dropout: on a CPU its attention runs the math kernel, whose
    float32 scores, softmax and dropout mask are per head, split by TP like the GeLU's intermediates.
    Checked against a real float32 run of the adapted block with two ranks' share of its heads."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, bos_token_id=0,
                                  eos_token_id=1)

    def factory():
        return transformers.GPT2LMHeadModel(cfg)

    p = profile_module(factory, SEQ, BATCH)
    split, f32 = p.act_bytes_tp_split_per_token_block["none"], p.act_bytes_float32_tp_split_per_token_block["none"]
    assert f32 >= 3 * 4 * 4 * SEQ  # scores, softmax, dropout mask: float32, heads x seq per token
    whole = _real_block_bytes(factory(), lambda m: m.layers["0"], torch.float32)

    def halved(m):
        halve_linears(m.layers["0"], p.tp_roles, device="cpu")
        return m.layers["0"]

    half = _real_block_bytes(factory(), halved, torch.float32)
    assert f32 + 2.0 * (split - f32) == pytest.approx(2.0 * (whole - half), rel=1e-6)
    # the cost model's GPT formula (no scores, GeLU's output only) would split far less: it takes the
    # measured split
    assert tp_split_bytes(dataclasses.replace(p, source="analytic"), "none") < 0.5 * split
    assert tp_split_bytes(p, "none") == split


def test_a_block_that_hard_codes_its_heads_has_no_measured_split():
    class Attn(nn.Module):
        def __init__(self, d=32, heads=4):
            super().__init__()
            self.heads, self.q, self.k, self.v, self.o = heads, *(nn.Linear(d, d) for _ in range(4))

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                       for t in (self.q(x), self.k(x), self.v(x)))
            return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.attn = nn.LayerNorm(32), Attn()

        def forward(self, x):
            return x + self.attn(self.norm(x))

    p = profile_module(lambda: TokenModel(Block, 32), SEQ, BATCH)
    assert p.act_bytes_tp_split_per_token_block == {}  # (its view needs all four heads)


def _tiny_transformers(kind: str):
    transformers = pytest.importorskip("transformers")
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                       tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ, bos_token_id=0,
                                  eos_token_id=1)
    return transformers.GPT2LMHeadModel(cfg)


def test_the_backward_working_set_is_measured_and_is_the_family_formula_on_llama():
    """One block's backward run on the fake tensors: on transformers' Llama the two f-wide gradients
    beside the one the SiLU's backward makes (the SwiGLU formula, net of the product freed), at
    16-bit; GPT-2's `gelu_new`, a chain of element-wise ops, holds more than GeLU's formula (one
    f-wide beyond the freed product); a conv block ending in a residual add, two feature maps."""
    llama = profile_module(lambda: _tiny_transformers("llama"), SEQ)
    assert llama.backward_working_bytes_per_token_block == 2 * llama.ffn_hidden * 2
    gpt2 = profile_module(lambda: _tiny_transformers("gpt2"), SEQ)
    assert gpt2.backward_working_bytes_per_token_block > 1 * gpt2.ffn_hidden * 2

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
    import _any_models as Z

    from dtorch.train.data import batch_for

    cnn = profile_module(Z.cnn, 1, sample=batch_for(Z.images(), [0, 1]), loss=Z.loss_fn("cross_entropy"))
    assert cnn.ffn_hidden == 0 and cnn.backward_working_bytes_per_token_block == 2 * cnn.hidden * 2


def test_the_planner_prices_the_measured_working_set_where_there_is_one():
    import dataclasses as dc

    from dtorch.cluster.load import parse_shorthand
    from dtorch.plan.cost import estimate
    from dtorch.plan.plan import Plan

    prof = profile_module(lambda: _tiny_transformers("gpt2"), SEQ)
    plan, cluster = Plan(dp_shard=2, microbatch_size=2, ac="full"), parse_shorthand("cpu:1x2")
    measured = estimate(plan, prof, cluster).memory_breakdown["activations"]
    by_family = estimate(plan, dc.replace(prof, backward_working_bytes_per_token_block=0.0), cluster)
    # the composite GELU's extra gradients, at float32 (the plan's compute dtype on a CPU) and 2 x SEQ rows
    extra = (prof.backward_working_bytes_per_token_block - prof.ffn_hidden * 2) * 2 * 2 * SEQ
    assert measured - by_family.memory_breakdown["activations"] == pytest.approx(extra)


def test_attention_dropout_is_measured_as_a_gpu_fused_kernel_keeps_it_where_asked():
    """On a CPU, attention with dropout runs the math kernel (the s x s scores, softmax and mask, in
    float32); a GPU's fused kernels take dropout and keep what they keep without it. Measured for a
    GPU (`fused_attention`), GPT-2 with attention dropout saves what GPT-2 without it saves; its
    FLOPs do not change, and a model without attention dropout is measured the same either way."""
    transformers = pytest.importorskip("transformers")

    def gpt2(attn_pdrop):
        return lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ, attn_pdrop=attn_pdrop,
            bos_token_id=0, eos_token_id=1))

    cpu = profile_module(gpt2(0.1), SEQ)
    gpu = profile_module(gpt2(0.1), SEQ, fused_attention=True)
    plain = profile_module(gpt2(0.0), SEQ)
    assert cpu.attention_dropout and gpu.attention_dropout and not plain.attention_dropout
    # the math kernel's float32 scores, softmax and dropped softmax, and the mask: 4 heads x SEQ each
    assert cpu.act_bytes_per_token_block["none"] - gpu.act_bytes_per_token_block["none"] >= 3 * 4 * 4 * SEQ
    for field in ("act_bytes_per_token_block", "act_bytes_float32_per_token_block", "flops_per_token_block",
                  "act_bytes_tp_split_per_token_block", "backward_working_bytes_per_token_block"):
        assert getattr(gpu, field) == getattr(plain, field), field
    assert cpu.flops_per_token_block == gpu.flops_per_token_block
    llama = profile_module(lambda: _tiny_transformers("llama"), SEQ, fused_attention=True)
    assert not llama.attention_dropout
    assert llama.to_dict() == profile_module(lambda: _tiny_transformers("llama"), SEQ).to_dict()


def test_a_gpu_cluster_is_planned_with_the_gpu_attention_and_a_cpu_one_with_the_cpu_one(tmp_path, monkeypatch):
    import dataclasses as dc

    from dtorch.cluster.load import parse_shorthand, preset_group
    from dtorch.plan import profiles

    pytest.importorskip("transformers")
    (tmp_path / "mygpt.py").write_text(
        "import transformers\n"
        "def build():\n"
        f"    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, "
        f"n_head=4, n_positions={SEQ}, bos_token_id=0, eos_token_id=1))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cpu = profiles.get_profile("mygpt:build", SEQ)
    assert cpu.attention_dropout
    assert profiles.for_devices(cpu, "mygpt:build", SEQ, parse_shorthand("cpu:1x2").groups) is cpu
    gpu = profiles.for_devices(cpu, "mygpt:build", SEQ, [preset_group("h100")])
    assert gpu.act_bytes_per_token_block["none"] < cpu.act_bytes_per_token_block["none"]
    # measured on a CPU, the math kernel's scores make the core unfused; on a GPU it is fused
    assert cpu.unfused_attention and not gpu.unfused_attention
    measured = dict(act_bytes_per_token_block={}, act_bytes_float32_per_token_block={},
                    act_bytes_tp_split_per_token_block={}, act_bytes_float32_tp_split_per_token_block={},
                    ops_per_block=0, unfused_attention=False, act_bytes_per_token_block_scores=0.0)
    assert dc.replace(gpu, **measured) == dc.replace(cpu, **measured)


def test_an_eager_attention_is_measured_unfused_and_priced_by_the_roofline_on_a_gpu():
    """transformers' eager attention (and any hand-written softmax(q k^T) v) saves [b, heads, s, s]
    tensors: the profile calls it unfused and counts those bytes; SDPA without dropout is fused. On
    a GPU the cost model prices those bytes by the unfused attention roofline, not as element-wise
    passes; on a CPU, whose attention runs at the GEMMs' speed, they stay element-wise passes."""
    transformers = pytest.importorskip("transformers")
    from dtorch.cluster.load import parse_shorthand
    from dtorch.plan.cost import step_shape
    from dtorch.plan.plan import Plan

    def gpt2(attn):
        return lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ, attn_pdrop=0.0,
            attn_implementation=attn, bos_token_id=0, eos_token_id=1))

    eager, sdpa = profile_module(gpt2("eager"), SEQ), profile_module(gpt2("sdpa"), SEQ)
    assert eager.unfused_attention and not sdpa.unfused_attention
    # at least the 16-bit softmax of 4 heads x SEQ scores per token, kept for its product with v
    assert 4 * SEQ * 2 <= eager.act_bytes_per_token_block_scores < eager.act_bytes_per_token_block["none"]
    plan = Plan(dp_shard=2, microbatch_size=1)
    gpu = step_shape(plan, eager, parse_shorthand("h100:1x2"))
    cpu = step_shape(plan, eager, parse_shorthand("cpu:1x2"))
    assert gpu.a_elem == eager.act_bytes_per_token_block["none"] - eager.act_bytes_per_token_block_scores
    assert cpu.a_elem == eager.act_bytes_per_token_block["none"]
    assert gpu.attn_speed < step_shape(plan, sdpa, parse_shorthand("h100:1x2")).attn_speed


class FoldedHeadsAttention(nn.Module):
    """A hand-written causal attention in the older style: the heads folded into the batch for
    `torch.bmm` ([batch x heads, s, d]), its own mask and softmax; `sdpa=True` calls SDPA instead, on
    [batch, heads, s, d] (the fused kernels take 4-D inputs only; SDPA runs 3-D ones as math)."""

    def __init__(self, d: int, heads: int, sdpa: bool):
        super().__init__()
        self.heads, self.sdpa, self.qkv, self.proj = heads, sdpa, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            q, k, v = (t.reshape(b * self.heads, s, -1) for t in (q, k, v))
            att = torch.bmm(q, k.transpose(1, 2)) / (d // self.heads) ** 0.5
            att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
            y = torch.bmm(att, v)
        return self.proj(y.reshape(b, self.heads, s, -1).transpose(1, 2).reshape(b, s, d))


def test_attention_with_its_heads_folded_into_the_batch_is_measured_unfused():
    """[batch x heads, s, s] scores (a `bmm` attention) are an unfused core as [batch, heads, s, s]
    ones are; the same model calling SDPA is fused. The hidden width equals the sequence here, so a
    [batch, s, h] activation has the scores' last two dimensions: it is not taken for them."""

    class Block(nn.Module):
        def __init__(self, sdpa):
            super().__init__()
            self.ln, self.attn, self.mlp = nn.LayerNorm(SEQ), FoldedHeadsAttention(SEQ, 4, sdpa), nn.Linear(SEQ, SEQ)

        def forward(self, x):
            x = x + self.attn(self.ln(x))
            return x + torch.relu(self.mlp(x))

    bmm, sdpa = (profile_module(partial(TokenModel, partial(Block, fused), SEQ), SEQ, BATCH)
                 for fused in (False, True))
    assert bmm.unfused_attention and not sdpa.unfused_attention
    # the softmax (4 heads x SEQ per token, float32 here) at least, kept for its product with v
    assert 4 * SEQ * 2 <= bmm.act_bytes_per_token_block_scores < bmm.act_bytes_per_token_block["none"]
    assert sdpa.act_bytes_per_token_block_scores == 0


def test_the_trainers_search_for_gpus_measures_attention_as_they_run_it():
    """The Trainer's own planner (`PlanResolver.search`) for a cluster of GPUs measures a model with
    attention dropout again as their fused kernels run it; for CPUs it keeps the CPU measurement.
    Planning only: no GPU is needed to choose a plan for one."""
    transformers = pytest.importorskip("transformers")
    from dtorch.train.resolve import PlanRequest, PlanResolver

    def build():
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ, bos_token_id=0, eos_token_id=1))

    tokens = torch.randint(0, 256, (2, SEQ + 1))
    sample = (tokens[:, :-1], tokens[:, 1:])

    def loss(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    found = {}
    for cluster in ("h100:1x2", "cpu:1x2"):
        resolver = PlanResolver(PlanRequest("auto", 8, SEQ, cluster), build, loss, lambda: sample)
        resolver.search(2, {})
        found[cluster] = resolver.profile
    gpu, cpu = found["h100:1x2"], found["cpu:1x2"]
    assert gpu.attention_dropout and cpu.attention_dropout
    assert not gpu.unfused_attention and cpu.unfused_attention
    assert gpu.act_bytes_per_token_block["none"] < cpu.act_bytes_per_token_block["none"]
