"""Impossible plans are rejected with the field and the fix, before any process group exists."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dtorch.errors import ConfigError
from dtorch.models import build_model
from dtorch.parallel import parallelize
from dtorch.plan.plan import Plan
from dtorch.train.losses import next_token


def _factory():
    return build_model("llama-tiny")  # 4 heads, 2 kv heads, 4 blocks


@pytest.mark.parametrize(
    ("plan", "seq_len", "field", "words"),
    [
        (Plan(tp=4), 16, "tp", "does not divide 2 key/value heads"),
        (Plan(tp=3), 16, "tp", "use tp in {1, 2}"),  # tp=4 divides the 4 heads, not the 2 kv heads
        (Plan(pp=4, schedule="1f1b", num_microbatches=2), 16, "num_microbatches", "schedule=gpipe"),
        (Plan(pp=2, virtual_stages=4, schedule="interleaved_1f1b", num_microbatches=4), 16, "virtual_stages",
         "at most 4 stages"),
        (Plan(pp=2, virtual_stages=2, schedule="interleaved_1f1b", num_microbatches=3), 16, "num_microbatches",
         "multiple of 2"),
        (Plan(tp=2, sp=True), 15, "seq_len", "multiple of 2"),
        (Plan(tp=2, cp=2), 20, "seq_len", "tp*2*cp = 8"),
        (Plan(cp=2, pp=2, num_microbatches=2, schedule="zero_bubble"), 16, "reshard_after_forward",
         "reshard_after_forward=false"),
        (Plan(tp=2, sp=True, pp=2, virtual_stages=2, schedule="zero_bubble", num_microbatches=2), 16,
         "schedule", "interleaved_1f1b"),
        (Plan(pp=2, layer_partition=[1, 2], num_microbatches=2), 16, "layer_partition", "model has 4 blocks"),
    ],
)
def test_invalid_plan_is_rejected_before_any_process_group(plan: Plan, seq_len: int, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parallelize(_factory, plan, loss_fn=next_token, seq_len=seq_len)
    assert err.value.field == field
    assert words in str(err.value)
    assert not dist.is_initialized()


def test_single_process_plan_runs_without_a_process_group() -> None:
    pm = parallelize(_factory, Plan(num_microbatches=2), loss_fn=next_token, seed=3)
    x = torch.randint(0, 256, (4, 16))
    ref = build_model("llama-tiny")
    ref.init_weights(3)
    assert float(pm.forward_backward(x, x)) == pytest.approx(float(next_token(ref(x), x).detach()), rel=1e-6)
    assert set(pm.state_dict_for_checkpoint()) == set(ref.state_dict())
    assert not dist.is_initialized()


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = torch.nn.Linear(8, 16)
        self.proj_out = torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.proj_out(torch.relu(self.proj_in(x)))


class _Custom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = {"n_heads": 2}
        self.layers = torch.nn.ModuleDict({"0": _Block()})

    def forward(self, x):
        return self.layers["0"](x)


def test_unknown_layer_role_names_the_module_and_the_annotation_that_fixes_it() -> None:
    from dtorch.parallel import annotate
    from dtorch.parallel.tp import check_roles

    model = _Custom()
    with pytest.raises(ConfigError) as err:
        parallelize(model, Plan(tp=2), loss_fn=next_token)
    assert err.value.field == "tp" and "layers.0.proj_in: " in err.value.fix  # (refused as not applying)
    assert "dtorch.parallel.annotate(module" in str(err.value)
    assert not dist.is_initialized()
    annotate(model.layers["0"].proj_in, "colwise")
    annotate(model.layers["0"].proj_out, "rowwise")
    check_roles(model, sp=False)  # no error once annotated


class _HeadsAttention(torch.nn.Module):
    """Attention with torchtitan's layer names; `heads_named`: q/k/v reshaped as view(b, -1, heads,
    head_dim) (OPT's and BART's way), else view(b, s, -1, head_dim)."""

    def __init__(self, dim: int, heads: int, heads_named: bool):
        super().__init__()
        self.n_heads, self.heads_named = heads, heads_named
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        shape = (b, -1, self.n_heads, d // self.n_heads) if self.heads_named else (b, s, -1, d // self.n_heads)
        q, k, v = (lin(x).view(*shape).transpose(1, 2) for lin in (self.wq, self.wk, self.wv))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class _HeadsLM(torch.nn.Module):
    def __init__(self, heads_named: bool):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList(_HeadsAttention(32, 4, heads_named) for _ in range(2))
        self.output = torch.nn.Linear(32, 64)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.output(x)


def test_attention_that_reshapes_by_the_total_head_count_is_refused_for_tp() -> None:
    """Under TP a rank holds half of q/k/v's features: view(b, -1, heads, head_dim) reads them as half
    the tokens, every shape still fits and the loss is wrong. The executor refuses it before any
    process group, and the planner does not offer TP, with the same line; view(b, s, -1, head_dim)
    splits by heads and is accepted."""
    from dtorch.model.profiler import profile_module
    from dtorch.parallel.tp import check_roles

    with pytest.raises(ConfigError) as err:
        parallelize(lambda: _HeadsLM(True), Plan(tp=2), loss_fn=next_token, seq_len=8)
    assert err.value.field == "tp" and "layers.0" in err.value.fix and "total head count" in err.value.fix
    assert not dist.is_initialized()
    named = profile_module(lambda: _HeadsLM(True), 8, dtype=torch.float32)
    assert named.tp_roles == {} and "total head count" in named.tp_roles_reason
    with torch.device("meta"):
        check_roles(_HeadsLM(False), sp=False)
    assert profile_module(lambda: _HeadsLM(False), 8, dtype=torch.float32).tp_roles["wq"] == "colwise"


def test_model_without_repeated_blocks_runs_as_one_unit() -> None:
    # (docs/models.md: an MLP has no blocks; data parallelism treats the whole model as one unit)
    pm = parallelize(lambda: torch.nn.Sequential(torch.nn.Linear(2, 2)), Plan(), loss_fn=torch.nn.functional.mse_loss)
    loss = pm.forward_backward(torch.ones(2, 2), torch.zeros(2, 2))
    assert loss.dim() == 0 and all(p.grad is not None for p in pm.parameters())
    with pytest.raises(ConfigError) as err:  # tensor parallelism needs heads
        parallelize(lambda: torch.nn.Sequential(torch.nn.Linear(2, 2)), Plan(tp=2), loss_fn=next_token)
    assert err.value.field == "tp"


def test_context_parallel_transformers_model_is_refused_before_any_process_group() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    with pytest.raises(ConfigError) as err:
        parallelize(lambda: transformers.LlamaForCausalLM(cfg), Plan(cp=2), loss_fn=next_token, seq_len=16)
    assert err.value.field == "cp"
    assert "token_positions" in str(err.value) and "use cp=1" in str(err.value)
    assert not dist.is_initialized()


def test_context_parallel_shards_cover_the_sequence_once_with_equal_causal_work() -> None:
    from dtorch.parallel.cp import shard_positions

    for cp in (2, 3, 4):
        shards = [shard_positions(24, cp, r) for r in range(cp)]
        assert sorted(torch.cat(shards).tolist()) == list(range(24))
        # causal work of a rank: the number of keys its queries attend to (position + 1 each)
        assert len({int((s + 1).sum()) for s in shards}) == 1


def test_optimizer_offload_is_run_by_the_executor_and_offered_by_the_planner():
    import pytest

    from dtorch.errors import ConfigError
    from dtorch.parallel.check import check_executable
    from dtorch.plan.limits import unsupported
    from dtorch.plan.plan import Plan

    # the executor applies both optimizer tiers (dtorch.train.offload) and the planner's list agrees
    for tier in ("optimizer", "optimizer_nvme"):
        check_executable(Plan(dp_shard=2, offload=tier))
        assert unsupported(Plan(dp_shard=2, offload=tier)) is None
    # and the executor's other limits still hold for such a plan
    with pytest.raises(ConfigError, match="cp_attention"):
        check_executable(Plan(cp=2, cp_attention="ring", compile=True, offload="optimizer"))
