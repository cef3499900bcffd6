"""Hugging Face GPT-2 under tensor (and sequence) parallelism with no hand-written plan.

The adapter rebuilds GPT-2's fused Conv1D projections as nn.Linear layers; the unit tests pin that
this is exact (logits of the adapted and the original model agree to 1e-6 on CPU) and leaves the
caller's model and torch's RNG alone. The multi-process tests train the tiny GPT-2 of _training.py
for 5 AdamW steps under TP and TP+SP with gradient accumulation (world 2), and compare losses and
gradient norms with the UNMODIFIED transformers model trained on one process (not the adapter),
within the loss-equivalence tolerance (FSDP x TP+SP at world 4: test_loss_equivalence.py).
"""

from __future__ import annotations

import sys
from functools import cache, partial
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _training  # noqa: E402
from _harness import run_group  # noqa: E402

from dtorch.errors import ConfigError  # noqa: E402
from dtorch.parallel import parallelize  # noqa: E402
from dtorch.parallel.hf import adapt  # noqa: E402
from dtorch.parallel.tp import check_roles  # noqa: E402
from dtorch.plan.plan import Plan  # noqa: E402
from dtorch.train.losses import next_token  # noqa: E402

REL = 1e-4


def _gpt2(**overrides) -> GPT2LMHeadModel:
    cfg = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1)
    return GPT2LMHeadModel(GPT2Config(**{**cfg, **overrides}))


@pytest.mark.parametrize("overrides", [
    {}, {"tie_word_embeddings": False}, {"scale_attn_by_inverse_layer_idx": True}, {"n_inner": 96},
], ids=["tied", "untied", "inverse_layer_scale", "n_inner"])
def test_adapted_gpt2_gives_the_original_logits(overrides: dict) -> None:
    torch.manual_seed(0)
    model = _gpt2(**overrides).eval()
    adapted = adapt(model).eval()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(adapted(x), model(x).logits, atol=1e-6, rtol=0)
    assert adapted.tied() == (overrides.get("tie_word_embeddings", True))


def test_adapted_gpt2_gives_the_original_gradients() -> None:
    torch.manual_seed(0)
    model = _gpt2(tie_word_embeddings=False).eval()  # eval: no dropout
    adapted = adapt(model).eval()
    x, y = torch.randint(0, 256, (2, 2, 16))
    next_token(model(x).logits, y).backward()
    next_token(adapted(x), y).backward()
    attn, mlp = model.transformer.h[1].attn, model.transformer.h[1].mlp
    block = adapted.layers["1"]
    q, k, v = attn.c_attn.weight.grad.split(64, dim=1)
    torch.testing.assert_close(block.attn.k_proj.weight.grad, k.t(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(block.attn.v_proj.bias.grad, attn.c_attn.bias.grad[128:], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(block.mlp.down_proj.weight.grad, mlp.c_proj.weight.grad.t(), atol=1e-6, rtol=1e-5)


def test_adapting_gpt2_leaves_the_model_and_the_rng_alone() -> None:
    torch.manual_seed(0)
    model = _gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    adapted = adapt(model)
    assert torch.equal(torch.get_rng_state(), rng)  # no initialiser ran: the next draws are the user's
    assert type(model.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    with torch.no_grad():
        adapted.layers["0"].attn.q_proj.weight.add_(1.0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_gpt2_has_a_tensor_parallel_role_for_every_layer() -> None:
    with torch.device("meta"):
        model = adapt(_gpt2(tie_word_embeddings=False))
    check_roles(model, sp=True)  # raises ConfigError naming the first layer without a role


def test_gpt2_heads_not_divisible_by_tp_is_rejected_before_any_process_group() -> None:
    with pytest.raises(ConfigError) as err:
        parallelize(partial(_gpt2, n_head=2, n_embd=64, tie_word_embeddings=False), Plan(tp=4),
                    loss_fn=next_token)
    assert err.value.field == "tp" and "{1, 2}" in str(err.value)
    assert not torch.distributed.is_initialized()


CASES_2 = {
    "tp": dict(model="hf-gpt2", tp=2, microbatch_size=4),
    "tp_sp_accumulation": dict(model="hf-gpt2", tp=2, sp=True, microbatch_size=2, num_microbatches=2),
}
# FSDP x TP+SP at world 4 runs in test_loss_equivalence.py's world-4 group (hf_gpt2_fsdp_x_tp_sp):
# a second group of 4 processes would cost more than the case.



TIED = "tied_tp_sp_logits"


def _worker(case: tuple[str, dict], rank: int) -> dict:
    return _tied_tp_logits() if case[0] == TIED else _training.parallel(case[1], rank)


def _tied_tp_logits() -> dict:
    """apply_tp (TP+SP over both ranks) on the meta adapter of a TIED GPT-2, materialised from the
    real model: is the tie kept, and are the logits the original model's? (Training tied models
    on every plan: test_tied.py.)"""
    from torch.distributed.device_mesh import init_device_mesh

    from dtorch.parallel.materialize import Startup, materialize
    from dtorch.parallel.tp import apply_tp

    torch.manual_seed(0)
    hf = _gpt2().eval()
    with torch.device("meta"):
        model = adapt(_gpt2())
    apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sp=True, loss_parallel=False)
    tied = model.output.weight is model.tok_embeddings.weight
    materialize([model], Startup(adapt(hf), model, 0), torch.device("cpu"))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model.eval()(x) - hf(x).logits).abs().max()
    return {"tied": tied, "placements": str(model.output.weight.placements), "max_abs_diff": float(diff)}


@cache
def _hf_reference(global_batch: int) -> dict:
    """The unmodified transformers model trained on one process: seed, construct, 5 AdamW steps."""
    torch.manual_seed(0)
    model = _training.factory("hf-gpt2")
    keys = sorted(adapt(model).state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=_training.LR)
    losses, norms = [], []
    for step in range(_training.STEPS):
        x, y = _training.batch(step, global_batch)
        loss = next_token(model(x).logits, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "keys": keys}


@pytest.fixture(scope="module")
def world2() -> dict:
    cases = [*CASES_2.items(), (TIED, {})]
    return dict(zip([name for name, _ in cases], run_group(2, cases, _worker)))


def _assert_matches_hf(plan_kwargs: dict, per_rank: list[dict]) -> None:
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    plan = Plan(**{k: v for k, v in plan_kwargs.items() if k != "model"})
    ref = _hf_reference(plan.dp * plan.local_batch())
    for r, res in enumerate(per_rank):
        worst = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], ref["losses"]))
        print(f"rank {r}: max relative loss difference {worst:.2e}")
        for key in ("losses", "norms"):
            assert res[key] == pytest.approx(ref[key], rel=REL), f"rank {r} {key}"
    assert set().union(*(res["keys"] for res in per_rank)) == set(ref["keys"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_2))
def test_gpt2_world_size_2_matches_single_process_transformers(world2: dict, name: str) -> None:
    _assert_matches_hf(CASES_2[name], world2[name])


@pytest.mark.slow
def test_tied_gpt2_embeddings_stay_tied_under_tp_and_give_the_original_logits(world2: dict) -> None:
    for r, res in enumerate(world2[TIED]):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        assert res["tied"] and res["placements"] == "(Shard(dim=0),)"
        assert res["max_abs_diff"] < 1e-5
