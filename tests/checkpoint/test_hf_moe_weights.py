"""Hugging Face mixtures of experts into DTorch's MoETransformer: tiny transformers Mixtral,
Qwen2-MoE (q/k/v biases, gated shared expert) and Qwen3-MoE (per-head q/k norms, a dense first
block), saved with save_pretrained in the Hub's layout (one tensor per expert), mapped from their
config.json and loaded slice by slice; the logits equal transformers' own. Also under expert
parallelism at world 2, where each rank reads only its experts. Export is the exact inverse:
loaded and exported again, every tensor and config.json are bit-identical to the Hub directory.
About 20 s (transformers import, one group of 2 gloo processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
sys.path.insert(0, str(Path(__file__).parent))
from _harness import run_group  # noqa: E402

from dtorch.checkpoint.hf_weights import HFWeights, load_model_config  # noqa: E402
from dtorch.errors import ConfigError  # noqa: E402
from dtorch.models.configs import MoEConfig  # noqa: E402

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
VOCAB, SEQ, REL_LOGITS = 128, 16, 1e-5


def _hf_model(family: str):
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                  num_experts_per_tok=2)
    if family == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(**common, intermediate_size=48, num_local_experts=4))
    if family == "qwen2_moe":
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=64, num_experts=4))
    # head_dim 32 != hidden/heads = 16, top-k probabilities renormalised, block 0 dense
    return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**common, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
                                                  num_experts=4, norm_topk_prob=True, mlp_only_layers=[0]))


def _save(family: str, directory: Path) -> Path:
    torch.manual_seed(7)
    hf = _hf_model(family)
    with torch.no_grad():  # norms 1 and biases 0 would hide a mapping mistake
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(directory)
    return directory


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(99))


def _hf_logits(directory: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(_tokens()).logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    return {f: _save(f, root / f) for f in FAMILIES}


def test_hub_layout_is_one_tensor_per_expert(dirs: dict[str, Path]) -> None:
    from dtorch.checkpoint.hf_weights import tensor_shapes

    names = tensor_shapes(dirs["mixtral"])
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert not any("gate_up_proj" in n for n in tensor_shapes(dirs["qwen3_moe"]))


def test_configs_map_onto_the_moe_model(dirs: dict[str, Path]) -> None:
    fam, cfg = load_model_config(dirs["mixtral"])
    assert fam == "mixtral" and isinstance(cfg, MoEConfig)
    assert (cfg.n_experts, cfg.top_k, cfg.expert_hidden, cfg.norm_topk_prob, cfg.n_shared_experts) == (4, 2, 48, True, 0)
    _, q2 = load_model_config(dirs["qwen2_moe"])
    assert (q2.n_shared_experts, q2.shared_expert_gate, q2.qkv_bias, q2.norm_topk_prob) == (2, True, True, False)
    _, q3 = load_model_config(dirs["qwen3_moe"])
    assert (q3.qk_norm, q3.head_dim, q3.n_dense_layers, q3.ffn_hidden) == (True, 32, 1, 96)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(dirs: dict[str, Path], family: str) -> None:
    from dtorch.models import build_from_config
    from dtorch.parallel.materialize import Startup, materialize

    _, cfg = load_model_config(dirs[family])
    with torch.device("meta"):
        model = build_from_config(cfg)
    materialize([model], Startup(None, model, 0, HFWeights(dirs[family])), torch.device("cpu"))
    with torch.no_grad():
        logits = model.eval()(_tokens())
    assert _rel(logits, _hf_logits(dirs[family])) < REL_LOGITS


def test_unsupported_moe_setting_is_refused(dirs: dict[str, Path], tmp_path: Path) -> None:
    import json
    import shutil

    d = tmp_path / "jitter"
    shutil.copytree(dirs["mixtral"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "router_jitter_noise": 0.1}))
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        load_model_config(d)


def test_expert_parallel_ranks_load_their_experts_with_the_same_logits(dirs: dict[str, Path]) -> None:
    d = dirs["mixtral"]
    from _moe_load import ep_worker  # a module without transformers: the spawned ranks import it fast

    (per_rank,) = run_group(2, [str(d)], ep_worker)
    ref = _hf_logits(d)
    from dtorch.checkpoint.hf_weights import tensor_shapes

    total = sum(torch.Size(s).numel() * 4 for s, _ in tensor_shapes(d).values())
    for res in per_rank:
        assert "error" not in res, res.get("error")
        assert _rel(torch.tensor(res["logits"]), ref) < REL_LOGITS
        assert res["bytes_read"] < 0.75 * total  # FSDP and EP shards: no rank reads the whole checkpoint


def _load(directory: Path):
    from dtorch.models import build_from_config
    from dtorch.parallel.materialize import Startup, materialize

    _, cfg = load_model_config(directory)
    with torch.device("meta"):
        model = build_from_config(cfg)
    materialize([model], Startup(None, model, 0, HFWeights(directory)), torch.device("cpu"))
    return cfg, model


def _all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _meta_keys(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in ("transformers_version", "_name_or_path")}


@pytest.mark.parametrize("family", FAMILIES)
def test_export_is_the_exact_inverse_of_loading(dirs: dict[str, Path], tmp_path: Path, family: str) -> None:
    """Hub directory -> MoETransformer -> DCP checkpoint -> export_hf: the same tensor names, bit for
    bit (experts unstacked, rotary rows and q/k norms permuted back), over several shard files, and
    the same config.json."""
    import json

    import torch.distributed.checkpoint as dcp

    from dtorch.checkpoint.hf_weights import export_hf

    cfg, model = _load(dirs[family])
    # the balancing buffers a Hub checkpoint does not hold start at zero (not to_empty's garbage)
    assert all(not m.expert_bias.any() and not m.expert_load.any() for m in model.moe_modules())
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    base = json.loads((dirs[family] / "config.json").read_text())
    out = export_hf(tmp_path / "ck", tmp_path / "hf", cfg, family=family, base_config=base, max_shard_bytes=100_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    want, got = _all_tensors(dirs[family]), _all_tensors(out)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert _meta_keys(json.loads((out / "config.json").read_text())) == _meta_keys(base)


def test_a_mixtral_shaped_preset_exports_for_transformers(tmp_path: Path) -> None:
    """Without a base config (a run from a DTorch spec): the written config.json alone makes
    transformers build the same model (logits within 1e-5)."""
    import torch.distributed.checkpoint as dcp

    from dtorch.checkpoint.hf_weights import export_hf
    from dtorch.models import build_model, model_config

    spec = "mixtral-tiny:aux_loss_coef=0"
    model = build_model(spec).eval()
    with torch.no_grad():  # norms 1 would hide a mapping mistake
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    out = export_hf(tmp_path / "ck", tmp_path / "hf", model_config(spec))
    tokens = _tokens() % model.config.vocab_size
    with torch.no_grad():
        ours = model(tokens)
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(theirs(tokens).logits, ours) < REL_LOGITS


def test_export_refuses_what_the_family_cannot_express(tmp_path: Path) -> None:
    """Before writing anything: a shared expert without Qwen2-MoE's gate (moe-tiny), and a nonzero
    auxiliary-loss-free routing bias."""
    import torch.distributed.checkpoint as dcp

    from dtorch.checkpoint.hf_weights import export_hf
    from dtorch.models import build_model, model_config

    model = build_model("moe-tiny")
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    with pytest.raises(ConfigError, match="shared_expert_gate"):
        export_hf(tmp_path / "ck", tmp_path / "hf", model_config("moe-tiny"))
    model = build_model("mixtral-tiny:bias_update_speed=0.001")
    model.layers["1"].feed_forward.expert_bias[3] = 0.002
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ck2"), no_dist=True)
    with pytest.raises(ConfigError, match="expert_bias"):
        export_hf(tmp_path / "ck2", tmp_path / "hf2", model_config("mixtral-tiny:bias_update_speed=0.001"))
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf2").exists()
