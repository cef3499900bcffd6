"""The reference models: shapes, deterministic init, meta materialisation, pipeline splits, specs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from dtorch.errors import ConfigError
from dtorch.models import PRESETS, GPTConfig, LlamaConfig, build_model, model_config

TINY = ["llama-tiny", "gpt-tiny"]


def _tokens(batch: int = 2, seq: int = 16, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", TINY)
def test_forward_maps_tokens_to_logits_of_vocab_size(name):
    model = build_model(name)
    logits = model(_tokens(3, 20))
    assert logits.shape == (3, 20, 256)
    assert logits.dtype == torch.float32


@pytest.mark.parametrize("name", TINY)
def test_modules_follow_torchtitan_names(name):
    model = build_model(name)
    names = {n for n, _ in model.named_modules()}
    for sub in ("tok_embeddings", "norm", "output", "layers.0.attention_norm", "layers.0.ffn_norm",
                "layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv",
                "layers.0.attention.wo", "layers.0.feed_forward.w1", "layers.0.feed_forward.w2"):
        assert sub in names, sub
    assert isinstance(model.layers, nn.ModuleDict)
    assert list(model.layers.keys()) == [str(i) for i in range(model.config.n_layers)]
    assert ("layers.0.feed_forward.w3" in names) == (name == "llama-tiny")
    assert ("pos_embeddings" in names) == (name == "gpt-tiny")


@pytest.mark.parametrize("name", TINY)
def test_same_seed_gives_identical_weights_and_other_seed_differs(name):
    a, b = build_model(name), build_model(name)
    a.init_weights(7)
    b.init_weights(7)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    b.init_weights(8)
    assert not torch.equal(a.layers["0"].attention.wq.weight, b.layers["0"].attention.wq.weight)
    assert not torch.equal(a.layers["0"].attention.wq.weight, a.layers["1"].attention.wq.weight)


@pytest.mark.parametrize("name", TINY)
def test_meta_build_to_empty_init_equals_direct_build(name):
    direct = build_model(name)
    direct.init_weights(3)
    with torch.device("meta"):
        lazy = build_model(name)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.init_weights(3)
    for (n, pd), pl in zip(direct.named_parameters(), lazy.parameters()):
        assert torch.equal(pd, pl), n
    for (n, bd), bl in zip(direct.named_buffers(), lazy.buffers()):
        assert torch.equal(bd, bl), n
    tokens = _tokens()
    assert torch.equal(direct(tokens), lazy(tokens))


def test_init_std_and_scaled_residual_projections():
    model = build_model("llama-tiny:hidden=256,heads=4,kv_heads=2,layers=8")
    wq = model.layers["0"].attention.wq.weight
    wo = model.layers["0"].attention.wo.weight
    assert abs(wq.std().item() - 0.02) < 0.002
    assert abs(wo.std().item() - 0.02 / 4.0) < 0.0005  # 0.02 / sqrt(2 * 8 layers)
    assert torch.equal(model.norm.weight, torch.ones(256))


def _split(model: nn.Module, first_stage_layers: int) -> tuple[nn.Module, nn.Module]:
    """torchtitan-style pipeline split of a deep copy: part A keeps the inputs and the first layers,
    part B the other layers and the outputs."""
    import copy

    a, b = copy.deepcopy(model), copy.deepcopy(model)
    n = model.config.n_layers
    for i in range(first_stage_layers, n):
        del a.layers[str(i)]
    for i in range(first_stage_layers):
        del b.layers[str(i)]
    for attr in model.output_modules:
        setattr(a, attr, None)
    for attr in model.input_modules:
        setattr(b, attr, None)
    return a, b


@pytest.mark.parametrize("name", TINY)
def test_pipeline_split_gives_the_same_logits_as_the_whole_model(name):
    model = build_model(name)
    tokens = _tokens()
    a, b = _split(model, 1)
    hidden = a(tokens)
    assert hidden.shape == (2, 16, model.config.dim)
    torch.testing.assert_close(b(hidden), model(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("name", TINY)
def test_pipeline_stage_built_alone_gets_the_whole_models_weights(name):
    whole = build_model(name)
    whole.init_weights(5)
    with torch.device("meta"):
        stage = build_model(name)
    _, stage = _split(stage, 2)
    stage.to_empty(device="cpu")
    stage.init_weights(5)
    whole_params = dict(whole.named_parameters())
    for n, p in stage.named_parameters():
        assert torch.equal(p, whole_params[n]), n


@pytest.mark.parametrize("name", TINY)
def test_attention_reads_local_head_count_from_weight_shapes(name):
    """What column-wise TP does to one rank: keep half of the heads in wq/wk/wv and the matching
    input columns of wo. The block must still run and equal the sum of the two halves."""
    model = build_model(name)
    attn = model.layers["0"].attention
    cfg = model.config
    x = torch.randn(2, 8, cfg.dim)
    args = (model.rope_cos[:8], model.rope_sin[:8]) if isinstance(cfg, LlamaConfig) else ()
    full = attn(x, *args)
    halves = []
    for r in range(2):
        import copy

        part = copy.deepcopy(attn)
        q_rows = cfg.dim // 2
        kv_rows = cfg.n_kv_heads * cfg.head_dim // 2
        for lin, rows in ((part.wq, q_rows), (part.wk, kv_rows), (part.wv, kv_rows)):
            lin.weight = nn.Parameter(lin.weight[r * rows:(r + 1) * rows])
            if lin.bias is not None:
                lin.bias = nn.Parameter(lin.bias[r * rows:(r + 1) * rows])
        part.wo.weight = nn.Parameter(part.wo.weight[:, r * q_rows:(r + 1) * q_rows])
        if part.wo.bias is not None:  # row-wise: the bias is added once, after the reduction
            part.wo.bias = nn.Parameter(part.wo.bias / 2)
        halves.append(part(x, *args))
    torch.testing.assert_close(halves[0] + halves[1], full, rtol=1e-5, atol=1e-6)


def test_gpt_dropout_is_configurable_and_off_by_default():
    assert GPTConfig.preset("gpt-tiny").dropout == 0.0
    model = build_model("gpt-tiny", dropout=0.5).train()
    tokens = _tokens()
    assert not torch.equal(model(tokens), model(tokens))
    model.eval()
    assert torch.equal(model(tokens), model(tokens))


def test_presets_have_published_parameter_counts():
    with torch.device("meta"):
        counts = {n: sum(p.numel() for p in build_model(n).parameters())
                  for n in ("llama3-8b", "llama3-70b", "llama3-405b")}
    assert counts["llama3-8b"] == pytest.approx(8.03e9, rel=0.01)
    assert counts["llama3-70b"] == pytest.approx(70.6e9, rel=0.01)
    assert counts["llama3-405b"] == pytest.approx(405.9e9, rel=0.01)


def test_spec_strings_parse_into_configs():
    cfg = model_config("gpt:layers=24,hidden=2304,heads=24,vocab=51200,seq=2048")
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.vocab_size, cfg.max_seq_len, cfg.ffn_hidden) == (
        24, 2304, 24, 51200, 2048, 4 * 2304)
    cfg = model_config("llama:layers=2,hidden=128,heads=4,kv_heads=1,ffn=384,vocab=1000,seq=64")
    assert (cfg.n_layers, cfg.dim, cfg.n_kv_heads, cfg.ffn_hidden, cfg.vocab_size) == (2, 128, 1, 384, 1000)
    cfg = model_config("llama3-8b:layers=2", max_seq_len=4096)
    assert (cfg.n_layers, cfg.dim, cfg.max_seq_len) == (2, 4096, 4096)
    assert model_config("gpt2-small:hidden=1024,heads=16").ffn_hidden == 4096
    assert model_config("llama:layers=2,hidden=4096,heads=32").ffn_hidden == 11008  # Llama-2-7B rule
    assert LlamaConfig.preset("llama3-70b") == PRESETS["llama3-70b"]
    assert LlamaConfig.preset("llama3-70b") is not PRESETS["llama3-70b"]


@pytest.mark.parametrize("spec, named", [
    ("llama9-1t", "llama3-8b"),
    ("gpt:layers=2,hidden=64", "heads"),
    ("gpt:layers=two,hidden=64,heads=4", "layers"),
    ("llama:layers=2,hidden=64,heads=4,wings=2", "kv_heads"),
    ("llama:layers=2,hidden=64,heads=4,kv_heads=3", "n_kv_heads"),
    ("gpt:layers=2,hidden=65,heads=4", "n_heads"),
    ("gpt:layers", "key=value"),
    ("", "preset"),
])
def test_bad_specs_raise_config_error_naming_value_and_choices(spec, named):
    with pytest.raises(ConfigError) as err:
        build_model(spec)
    assert named in str(err.value)


def test_model_configs_import_without_torch():
    code = ("import sys; from dtorch.models import model_config, PRESETS; model_config('llama3-8b'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
