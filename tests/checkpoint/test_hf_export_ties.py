"""Tied in, tied out: a tied Hugging Face checkpoint loads into DTorch's reference model tied (head
and embedding one Parameter), trains tied, and exports tied (no lm_head.weight,
tie_word_embeddings true) with the source's tokenizer files and generation_config.json beside the
weights; transformers loads the export (model and tokenizer) and gives the trained model's logits.
A checkpoint whose head differs from its embedding exports untied."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from dtorch.checkpoint.export import export_hf_dir  # noqa: E402
from dtorch.checkpoint.hf_weights import RUN_FILES, HFWeights, load_model_config, save_run_config  # noqa: E402
from dtorch.checkpoint.manager import CheckpointManager  # noqa: E402
from dtorch.models import build_from_config  # noqa: E402
from dtorch.parallel.parallelize import parallelize  # noqa: E402
from dtorch.plan.plan import Plan  # noqa: E402
from dtorch.train.losses import next_token  # noqa: E402

VOCAB = 64


def _hf(family: str):
    import transformers as T

    if family == "gpt2":  # tied by default
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                              bos_token_id=0, eos_token_id=1))
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=32, tie_word_embeddings=True,
                                            bos_token_id=0, eos_token_id=1))


def _source(family: str, d: Path) -> Path:
    """A tied model directory with a tokenizer and a generation config, as the Hub ships them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    torch.manual_seed(3)
    _hf(family).save_pretrained(d)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w1").save_pretrained(d)
    GenerationConfig(bos_token_id=0, eos_token_id=1, max_new_tokens=7, do_sample=False).save_pretrained(d)
    return d


def _x() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_tied_model_loads_tied_trains_and_exports_tied_with_tokenizer(family: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _source(family, tmp_path / "src")
    _, cfg = load_model_config(src)
    assert cfg.tie_embeddings  # what --init-from builds
    pm = parallelize(lambda: build_from_config(cfg), Plan(), loss_fn=next_token, weights=HFWeights(src))
    (model,) = pm.model_parts
    assert model.output.weight is model.tok_embeddings.weight
    opt = torch.optim.AdamW(list(pm.parameters()), lr=1e-2)
    for step in range(2):
        t = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(step))
        pm.forward_backward(t[:, :-1], t[:, 1:])
        opt.step()
        opt.zero_grad()
    assert model.output.weight is model.tok_embeddings.weight

    run = tmp_path / "run"
    save_run_config(run, json.loads((src / "config.json").read_text()), src)  # what --init-from keeps
    assert (run / RUN_FILES / "tokenizer.json").is_file()
    mgr = CheckpointManager(run)
    try:
        mgr.save(2, {"model": pm.state_dict_for_checkpoint()})
        out = export_hf_dir(mgr, None, tmp_path / "hf")
    finally:
        mgr.close()
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.lm_head.weight is hf.get_input_embeddings().weight
    assert hf.generation_config.max_new_tokens == 7
    assert AutoTokenizer.from_pretrained(out)("w5 w9")["input_ids"] == [5, 9]
    with torch.no_grad():
        want = model.eval()(_x())
        got = hf(_x()).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_with_a_separate_head_exports_untied(tmp_path: Path) -> None:
    """A run that trained the head apart from the embedding (an older untied load of a tied
    checkpoint) must not be exported as tied: the head would be silently replaced."""
    from transformers import AutoModelForCausalLM

    src = _source("gpt2", tmp_path / "src")
    _, cfg = load_model_config(src)
    model = build_from_config(dataclasses.replace(cfg, tie_embeddings=True))
    model.init_weights(5)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["output.weight"] += 0.01
    run = tmp_path / "run"
    save_run_config(run, json.loads((src / "config.json").read_text()), src)
    mgr = CheckpointManager(run)
    try:
        mgr.save(1, {"model": state})
        out = export_hf_dir(mgr, None, tmp_path / "hf", tokenizer=src)
    finally:
        mgr.close()
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(hf.lm_head.weight, state["output.weight"])
    torch.testing.assert_close(hf.get_input_embeddings().weight, state["tok_embeddings.weight"])
