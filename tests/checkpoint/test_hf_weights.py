"""Pretrained Hugging Face weights in and out: tiny transformers Llama (with Llama 3 RoPE scaling,
sharded bf16 files), Mistral, Qwen2 (tied, q/k/v biases) and GPT-2 (tied, Conv1D), saved with
save_pretrained, loaded slice by slice into DTorch's reference models under FSDP x TP+SP (world 4)
and PP (world 2), fine-tuned, exported, and loaded back by transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from _harness import run_group  # noqa: E402

from dtorch.checkpoint.hf_weights import HFWeights, export_hf, load_model_config  # noqa: E402
from dtorch.errors import ConfigError  # noqa: E402

FAMILIES = ("llama", "mistral", "qwen2", "gpt2")
VOCAB, SEQ, STEPS, LR = 128, 16, 5, 1e-3
REL_LOGITS, REL_LOSS = 1e-5, 1e-4


def _hf_model(family: str):
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    if family == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}))
    if family == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**common, sliding_window=64))
    if family == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**{**common, "tie_word_embeddings": True}))
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          bos_token_id=0, eos_token_id=1))


def _save(family: str, directory: Path) -> Path:
    torch.manual_seed(7)
    hf = _hf_model(family)
    with torch.no_grad():  # norms 1 and biases 0 would hide a mapping mistake
        for n, p in hf.named_parameters():
            if "norm" in n or "ln_" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    if family == "llama":  # sharded, bf16: the index and a cast on load
        hf.to(torch.bfloat16).save_pretrained(directory, max_shard_size="100KB")
    else:
        hf.save_pretrained(directory)
    return directory


def _tokens(step: int = -1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def _hf_logits(directory: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(_tokens()[:, :-1]).logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: _save(f, root / f) for f in FAMILIES}


# ---- one process --------------------------------------------------------------------------------
def _single(directory: Path) -> dict:
    """DTorch's reference model loaded from `directory` in this process: logits, then 5 steps."""
    from dtorch.models import build_from_config
    from dtorch.parallel.materialize import Startup, materialize
    from dtorch.train.losses import next_token

    _, cfg = load_model_config(directory)
    with torch.device("meta"):
        model = build_from_config(cfg)
    materialize([model], Startup(None, model, 0, HFWeights(directory)), torch.device("cpu"))
    with torch.no_grad():
        logits = model.eval()(_tokens()[:, :-1])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        t = _tokens(step)
        loss = next_token(model(t[:, :-1]), t[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"logits": logits, "losses": losses, "model": model}


def test_single_process_logits_equal_transformers(dirs: dict[str, Path]) -> None:
    for family, d in dirs.items():
        assert _rel(_single(d)["logits"], _hf_logits(d)) < REL_LOGITS, family


def test_llama_directory_is_sharded_bf16_and_ranks_read_slices(dirs: dict[str, Path]) -> None:
    d = dirs["llama"]
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("*.safetensors"))) > 1
    w = HFWeights(d)
    from dtorch.models import build_from_config
    from dtorch.parallel.materialize import Startup, materialize

    with torch.device("meta"):
        model = build_from_config(w.config)
    materialize([model], Startup(None, model, 0, w), torch.device("cpu"))
    n = sum(p.numel() for p in model.parameters())
    assert w.bytes_read == 2 * n  # bf16: every element read once, nothing else


# ---- several processes --------------------------------------------------------------------------
def _logits(pm, x: torch.Tensor) -> torch.Tensor | None:
    """Full logits of the parallel model (pipeline: hidden states passed by send/recv), on every
    rank that has the last stage; None elsewhere."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if pm.plan.pp == 1:
            (part,) = pm.model_parts
            out = part.eval()(x)
            for m in part.modules():  # a forward without backward leaves the root unsharded
                if isinstance(m, FSDPModule):
                    m.reshard()
            return out.full_tensor() if isinstance(out, DTensor) else out
        (part,) = pm.model_parts
        rank = pm.mesh["pp"].get_local_rank()
        group = pm.mesh["pp"].get_group()
        if rank == 0:
            h = part.eval()(x)
            dist.send(h.contiguous(), group_dst=1, group=group)
            return None
        h = torch.empty(x.shape[0], x.shape[1], part.config.dim)
        dist.recv(h, group_src=0, group=group)
        return part.eval()(h)


def _worker(case: tuple[str, dict], rank: int) -> dict:
    import torch.distributed.checkpoint as dcp

    from dtorch.models import build_from_config
    from dtorch.parallel import parallelize
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    _, spec = case
    directory = Path(spec["dir"])
    _, cfg = load_model_config(directory)
    plan = Plan(**spec["plan"])
    pm = parallelize(lambda: build_from_config(cfg), plan, loss_fn=next_token, seq_len=SEQ,
                     weights=HFWeights(directory))
    out: dict = {"path": pm.startup["path"], "bytes_read": pm.startup["bytes_read"]}
    logits = _logits(pm, _tokens()[:, :-1]) if plan.cp == 1 else None  # CP: the loss checks the load
    if logits is not None:
        out["logits"] = logits.tolist()
    for part in pm.model_parts:
        part.train()
    opt = torch.optim.AdamW(list(pm.parameters()), lr=LR, foreach=False)
    local = plan.local_batch()
    losses = []
    for step in range(STEPS if spec.get("train", True) else 0):
        t = _tokens(step)
        rows = slice(pm.dp_rank * local, (pm.dp_rank + 1) * local)
        losses.append(float(pm.forward_backward(t[rows, :-1], t[rows, 1:])))
        opt.step()
        opt.zero_grad()
    out["losses"] = losses
    if spec.get("return_weights"):
        from torch.distributed.tensor import DTensor

        from dtorch.parallel.materialize import clean_name

        out["weights"] = {clean_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().tolist()
                          for part in pm.model_parts for n, p in part.named_parameters(remove_duplicate=False)}
    if spec.get("save"):
        dcp.save({"model": pm.state_dict_for_checkpoint()}, checkpoint_id=spec["save"])
        tuned = _logits(pm, _tokens()[:, :-1])
        if tuned is not None:
            out["tuned_logits"] = tuned.tolist()
    return out


FSDP_TP_SP = dict(dp_shard=2, tp=2, sp=True, microbatch_size=2)
PP = dict(pp=2, schedule="1f1b", num_microbatches=2, microbatch_size=2)
CP_TP_SP = dict(cp=2, tp=2, sp=True, microbatch_size=4)


@pytest.fixture(scope="module")
def world4(dirs: dict[str, Path], tmp_path_factory) -> dict:
    ck = tmp_path_factory.mktemp("dcp")
    cases = [(f, {"dir": str(d), "plan": FSDP_TP_SP, "save": str(ck / f)}) for f, d in dirs.items()]
    cases.append(("qwen2-cp", {"dir": str(dirs["qwen2"]), "plan": CP_TP_SP}))
    # the reverse of 4 -> 2: a checkpoint fine-tuned and saved by ONE process, loaded at world 4
    import torch.distributed.checkpoint as dcp

    tuned = _single(dirs["qwen2"])["model"]
    dcp.save({"model": tuned.state_dict()}, checkpoint_id=str(ck / "world1"), no_dist=True)
    base = json.loads((dirs["qwen2"] / "config.json").read_text())
    one = export_hf(ck / "world1", ck / "world1-hf", load_model_config(dirs["qwen2"])[1], family="qwen2",
                    base_config=base)
    cases.append(("qwen2-from-world1", {"dir": str(one), "plan": FSDP_TP_SP, "train": False,
                                        "return_weights": True}))
    results = run_group(4, cases, _worker)
    return {name: (res, ck / name) for (name, _), res in zip(cases, results)}


@pytest.fixture(scope="module")
def exported(world4: dict, dirs: dict[str, Path], tmp_path_factory) -> dict[str, Path]:
    out = {}
    root = tmp_path_factory.mktemp("export")
    for family in FAMILIES:
        _, ck = world4[family]
        hf, cfg = json.loads((dirs[family] / "config.json").read_text()), load_model_config(dirs[family])[1]
        out[family] = export_hf(ck, root / family, cfg, family=family, base_config=hf, max_shard_bytes=60_000)
    return out


@pytest.fixture(scope="module")
def world2(dirs: dict[str, Path], exported: dict[str, Path], tmp_path_factory) -> dict:
    ck = tmp_path_factory.mktemp("dcp2")
    cases = [(f, {"dir": str(d), "plan": PP, **({"save": str(ck / f)} if f == "mistral" else {})})
             for f, d in dirs.items()]
    # the llama checkpoint saved at world 4 (FSDP x TP), loaded at world 2 (PP) through its export
    cases.append(("llama-resharded", {"dir": str(exported["llama"]), "plan": PP, "train": False,
                                      "return_weights": True}))
    out = dict(zip([c[0] for c in cases], run_group(2, cases, _worker)))
    out["mistral-checkpoint"] = ck / "mistral"
    return out


def _check_parallel(results: list[dict], directory: Path) -> None:
    ref_logits = _hf_logits(directory)
    single = _single(directory)
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        assert res["path"] == "weights"
        if "logits" in res:
            assert _rel(torch.tensor(res["logits"]), ref_logits) < REL_LOGITS, f"rank {r}"
        assert res["losses"] == pytest.approx(single["losses"], rel=REL_LOSS), f"rank {r}"


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_x_tp_sp_world4_loads_logits_and_fine_tunes(world4: dict, dirs: dict[str, Path], family: str) -> None:
    results, _ = world4[family]
    _check_parallel(results, dirs[family])
    total = sum(p.numel() for p in _hf_model(family).parameters())
    # each rank reads about a quarter (replicated norms/biases aside), never the whole model
    assert max(res["bytes_read"] for res in results) < 0.5 * total * (2 if family == "llama" else 4)


@pytest.mark.slow
def test_cp_x_tp_sp_world4_loads_and_fine_tunes(world4: dict, dirs: dict[str, Path]) -> None:
    results, _ = world4["qwen2-cp"]
    _check_parallel(results, dirs["qwen2"])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_pp_world2_loads_logits_and_fine_tunes(world2: dict, dirs: dict[str, Path], family: str) -> None:
    _check_parallel(world2[family], dirs[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_back_into_transformers_with_identical_logits(
    world4: dict, exported: dict[str, Path], family: str
) -> None:
    results, _ = world4[family]
    d = exported[family]
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("model-*.safetensors"))) > 1
    tuned = torch.tensor(next(r["tuned_logits"] for r in results if "tuned_logits" in r))
    assert _rel(_hf_logits(d), tuned) < REL_LOGITS


@pytest.mark.slow
def test_checkpoint_saved_at_world4_loads_at_world2_identically(world4: dict, world2: dict) -> None:
    from dtorch.checkpoint.export import load_full_state_dict

    _, ck = world4["llama"]
    saved = load_full_state_dict(ck)["model"]  # what FSDP x TP ranks saved at world 4
    loaded: dict = {}
    for res in world2["llama-resharded"]:  # what the two pipeline stages hold at world 2
        assert "error" not in res, res.get("error")
        loaded.update(res["weights"])
    assert sorted(loaded) == sorted(saved)
    for name, t in saved.items():
        assert torch.equal(torch.tensor(loaded[name]), t), name


@pytest.mark.slow
def test_checkpoint_saved_at_world2_loads_at_world4_identically(world2: dict, dirs: dict[str, Path],
                                                                 tmp_path_factory) -> None:
    """The reverse of 4 -> 2: the mistral checkpoint fine-tuned by the two pipeline stages, exported,
    loaded by FSDP x TP+SP ranks at world 4."""
    from dtorch.checkpoint.export import load_full_state_dict

    ck = world2["mistral-checkpoint"]
    saved = load_full_state_dict(ck)["model"]
    hf, cfg = json.loads((dirs["mistral"] / "config.json").read_text()), load_model_config(dirs["mistral"])[1]
    out = export_hf(ck, tmp_path_factory.mktemp("w2export") / "mistral", cfg, family="mistral", base_config=hf)
    results = run_group(4, [("mistral-from-world2", {"dir": str(out), "plan": FSDP_TP_SP, "train": False,
                                                     "return_weights": True})], _worker)[0]
    for r, res in enumerate(results):
        assert "error" not in res, res.get("error")
        assert sorted(res["weights"]) == sorted(saved)
        for name, t in saved.items():
            assert torch.equal(torch.tensor(res["weights"][name]), t), (r, name)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_saved_by_one_process_loads_at_world4_identically(world4: dict) -> None:
    from dtorch.checkpoint.export import load_full_state_dict

    results, ck = world4["qwen2-from-world1"]
    saved = load_full_state_dict(ck.parent / "world1")["model"]
    for r, res in enumerate(results):  # every FSDP x TP rank gathers the full tensors of its shards
        assert "error" not in res, res.get("error")
        assert sorted(res["weights"]) == sorted(saved)
        for name, t in saved.items():
            assert torch.equal(torch.tensor(res["weights"][name]), t), (r, name)


# ---- bad input: one line, exit 2, before any process group --------------------------------------
def test_shape_mismatch_names_the_tensor(dirs: dict[str, Path], tmp_path: Path) -> None:
    from dtorch.train.trainer import Trainer

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in dirs["mistral"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 80
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \[96, 64\]"):
        Trainer(init_from=bad)


def test_unknown_architecture_and_vocab_overflow(dirs: dict[str, Path], tmp_path: Path) -> None:
    from dtorch.train.trainer import Trainer

    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ConfigError, match="unknown architecture"):
        Trainer(init_from=odd)

    class Data:
        vocab_size = VOCAB + 1

        def __len__(self) -> int:
            return 1

    with pytest.raises(ConfigError, match="vocabulary of 129 tokens"):
        Trainer(init_from=dirs["gpt2"], data=Data())


def test_cli_bad_checkpoint_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    proc = subprocess.run([sys.executable, "-m", "dtorch.cli", "train", "--nproc", "1", "--init-from", str(tmp_path),
                           "--steps", "1", "--checkpoint-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown architecture" in lines[0], proc.stderr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("spec", ["llama-tiny", "gpt-tiny"])
def test_reference_model_exports_to_a_directory_transformers_loads(spec: str, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from dtorch.models import build_model, model_config

    model = build_model(spec).eval()
    model.init_weights(11)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    out = export_hf(tmp_path / "ck", tmp_path / "hf", model_config(spec), max_shard_bytes=100_000)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(x)
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(x).logits
    assert _rel(got, want) < REL_LOGITS
