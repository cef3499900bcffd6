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
from _hf_archs import ARCHS, EAGER_ONLY, VOCAB, config, factory  # noqa: E402

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
