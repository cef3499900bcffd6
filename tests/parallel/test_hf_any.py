"""Any transformers causal LM as a model factory: the adapter gives transformers' own logits.

For every architecture of issue 27 (tiny configs in _hf_archs.py), with eager and SDPA attention:
the adapted model's logits equal `model(x).logits` within 1e-5, and changing the later half of the
tokens leaves the earlier positions' logits unchanged (the adapter builds the model's own causal /
sliding-window masks; eager attention has no causal default). Single process, about 10 s."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))
from _hf_archs import ARCHS, EAGER_ONLY, VOCAB, config, factory, world2_worker  # noqa: E402

from dtorch.parallel.hf import adapt  # noqa: E402

SEQ = 16
CASES = [(a, attn) for a in ARCHS for attn in ("eager", "sdpa") if not (attn == "sdpa" and a in EAGER_ONLY)]


@pytest.mark.parametrize("arch,attn", CASES, ids=[f"{a}-{m}" for a, m in CASES])
def test_adapted_logits_equal_transformers_and_are_causal(arch: str, attn: str) -> None:
    torch.manual_seed(0)
    model = factory(arch, attn).eval()
    adapted = adapt(model).eval()
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    later = x.clone()
    later[:, SEQ // 2:] = (later[:, SEQ // 2:] + 1) % VOCAB
    with torch.no_grad():
        ref, got, got_later = model(x).logits, adapted(x), adapted(later)
    assert (got - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max())
    torch.testing.assert_close(got_later[:, : SEQ // 2], got[:, : SEQ // 2], atol=1e-6, rtol=0)
    assert (got_later[:, SEQ // 2:] - got[:, SEQ // 2:]).abs().max() > 1e-3  # the check can fail


def test_sliding_window_shorter_than_the_sequence_is_modelled() -> None:
    """Mistral with a window of 6 over 16 tokens: the adapter's logits follow the window (they equal
    transformers', and differ from the same weights with full causal attention)."""
    torch.manual_seed(0)
    model = factory("mistral", "eager").eval()
    x = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        windowed = adapt(model)(x)
        model.config.sliding_window = None
        full = adapt(model)(x)
    assert (windowed[:, 6:] - full[:, 6:]).abs().max() > 1e-3
    torch.testing.assert_close(windowed[:, :6], full[:, :6], atol=1e-6, rtol=0)


def test_gradients_reach_every_parameter() -> None:
    """Training the adapter trains the user's model: every parameter gets a gradient."""
    torch.manual_seed(0)
    model = factory("qwen3", "eager")
    adapted = adapt(model)
    x = torch.randint(0, VOCAB, (2, SEQ))
    adapted(x).sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_a_config_is_the_causal_lm_config_of_its_arch() -> None:
    assert config("mistral").sliding_window == 6 and config("gpt2").n_layer == 2


# ---- world 2: DDP and TP against a plain single-process loop ------------------------------------
# A representative subset, all in ONE group of 2 gloo processes: per-head q/k norms inside the TP
# region (qwen3, gemma3 with sliding windows, qwen3_moe with replicated experts), GPT-NeoX's per-head
# fused query_key_value, Mistral's sliding window, and DTorch's own MoETransformer with Qwen3's q/k
# norms (the reference-model path of an --init-from Qwen3-MoE).
WORLD2 = [("qwen3", "eager", "tp"), ("qwen3", "sdpa", "ddp"), ("gemma3", "eager", "tp"),
          ("gpt_neox", "sdpa", "tp"), ("gpt_neox", "eager", "ddp"), ("mistral", "eager", "tp"),
          ("qwen3_moe", "sdpa", "tp"), ("dtorch-moe-qk-norm", "", "tp")]


@pytest.fixture(scope="module")
def world2() -> dict:
    from _harness import run_group

    return dict(zip(WORLD2, run_group(2, [list(c) for c in WORLD2], world2_worker)))


@pytest.mark.slow
@pytest.mark.parametrize("case", WORLD2, ids=["-".join(filter(None, c)) for c in WORLD2])
def test_world_2_losses_and_gradients_equal_the_single_process_loop(world2: dict, case: tuple) -> None:
    for r, res in enumerate(world2[case]):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        rel = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], res["ref"]))
        print(f"{case} rank {r}: losses {rel:.1e} relative, worst gradient {res['worst_grad']}")
        assert rel < 1e-5
        assert res["worst_grad"][0] < 1e-5, res["worst_grad"]
