"""Text corpora: tokenised once with a tokenizer.json, packed with document boundaries, the
sampler's order unchanged; `dtorch train --init-from --data --tokenizer` trains, resumes after
kill -9 bit-identically, and exports a directory transformers loads."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dtorch.errors import ConfigError
from dtorch.train.sampler import GlobalSampler
from dtorch.train.tokenize import Tokenizer, text_dataset

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau upsilon phi chi psi omega def return class import for while if else").split()


def _doc(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) + "."


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    from tokenizers import Tokenizer as Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("text")
    rng = random.Random(0)
    docs = [_doc(rng) for _ in range(300)]
    jsonl = root / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "dir").mkdir()
    (root / "dir" / "b.txt").write_text(docs[1])
    (root / "dir" / "a.md").write_text(docs[0])
    tok = Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=200, special_tokens=["<|endoftext|>"]))
    tok.save(str(root / "tok.json"))
    big = Tok.from_file(str(root / "tok.json"))
    big.add_tokens([f"extra{i}" for i in range(300)])  # more tokens than a 256-row embedding
    big.save(str(root / "big.json"))
    return {"root": root, "jsonl": jsonl, "dir": root / "dir", "tok": root / "tok.json", "big": root / "big.json",
            "docs": docs}


def test_parquet_text_column_gives_the_same_tokens_as_jsonl(corpus, tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": corpus["docs"], "id": list(range(len(corpus["docs"])))}), path,
                   row_group_size=64)  # several row groups: read in batches
    a = text_dataset(path, corpus["tok"], seq_len=32, cache=tmp_path / "pq")
    b = text_dataset(corpus["jsonl"], corpus["tok"], seq_len=32, cache=tmp_path / "js")
    assert a.num_documents == b.num_documents == len(corpus["docs"])
    assert list(a.tokens) == list(b.tokens) and list(a.doc_starts) == list(b.doc_starts)


def test_tokenised_once_packed_with_document_boundaries(corpus, tmp_path, monkeypatch) -> None:
    ds = text_dataset(corpus["jsonl"], corpus["tok"], seq_len=32, cache=tmp_path)
    tok = ds.tokenizer
    assert ds.num_documents == len(corpus["docs"]) and ds.vocab_size == tok.vocab_size <= 200
    toks = ds.tokens
    starts = list(ds.doc_starts) + [ds.num_tokens]
    for d in (0, 7, 299):  # each document decodes back, followed by the end-of-text token
        ids = toks[starts[d]:starts[d + 1]]
        assert ids[-1] == tok.eos_id and tok.decode(ids[:-1]) == corpus["docs"][d]
    b = ds.boundaries(3)
    pos = ds.positions(3)
    assert all(pos[int(i)] == 0 for i in b) and ds.documents_of(3)
    # the second time nothing is tokenised: the cached files are reused as they are
    mtime = ds.path.stat().st_mtime_ns
    monkeypatch.setattr(Tokenizer, "encode_batch", lambda *a: (_ for _ in ()).throw(AssertionError("re-tokenised")))
    again = text_dataset(corpus["jsonl"], corpus["tok"], seq_len=32, cache=tmp_path)
    assert again.path == ds.path and again.path.stat().st_mtime_ns == mtime
    # a directory of .txt/.md files: one document per file, in sorted path order (a.md, b.txt)
    monkeypatch.undo()
    d = text_dataset(corpus["dir"], corpus["tok"], seq_len=4, cache=tmp_path)
    assert d.num_documents == 2
    first = d.tokens[d.doc_starts[0]:d.doc_starts[1]]
    assert tok.decode(first[:-1]) == corpus["docs"][0]


def test_same_documents_in_the_same_order_at_world_1_2_4(corpus, tmp_path) -> None:
    ds = text_dataset(corpus["jsonl"], corpus["tok"], seq_len=16, cache=tmp_path)
    sampler = GlobalSampler(len(ds), 8, seed=5)
    for step in (0, 1, 17, 2 * len(ds) // 8 + 3):  # also past an epoch boundary
        seen = {}
        for dp in (1, 2, 4):
            idx = [i for r in range(dp) for i in sampler.local_indices(step, r, dp)]
            seen[dp] = [ds.documents_of(i) for i in idx], [ds[i][0].tolist() for i in idx]
        assert seen[1] == seen[2] == seen[4]


def test_bad_inputs_are_refused_with_the_fix(corpus, tmp_path) -> None:
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        Tokenizer(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(ConfigError, match='string field "text"'):
        text_dataset(bad, corpus["tok"], seq_len=4, cache=tmp_path)
    with pytest.raises(ConfigError, match="unknown corpus format"):
        text_dataset(corpus["tok"], corpus["tok"], seq_len=4, cache=tmp_path)


# ---- end to end -----------------------------------------------------------------------------------
def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "DTORCH_NO_CALIBRATION": "1", "DTORCH_RECORD_SAMPLES": "1",
            "DTORCH_CACHE": str(cache)}


def _losses(log_dir: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "step" in rec and "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1)).save_pretrained(d)
    return d


@pytest.mark.slow
def test_fine_tune_on_text_resumes_after_kill_bit_identically_and_exports(corpus, gpt2_dir, tmp_path) -> None:
    steps = 8

    def cmd(run: Path) -> list[str]:
        return [sys.executable, "-m", "dtorch.cli", "train", "--init-from", str(gpt2_dir), "--data",
                str(corpus["jsonl"]), "--tokenizer", str(corpus["tok"]), "--seq-len", "32", "--global-batch", "4",
                "--steps", str(steps), "--checkpoint-every", "2", "--checkpoint-dir", str(run), "--nproc", "2",
                "--plan", "dp_shard=2", "--sample-tokens", "0", "--no-progress", "--lr", "1e-3", "--warmup", "2"]

    env = _env(tmp_path / "cache")
    ref = tmp_path / "ref"
    proc = subprocess.run(cmd(ref), env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = _losses(ref)
    assert sorted(reference) == list(range(1, steps + 1))
    startup = [json.loads(ln) for ln in (ref / "metrics.jsonl").read_text().splitlines() if '"startup"' in ln]
    assert startup and startup[0]["path"] == "weights" and startup[0]["bytes_read"] > 0

    run = tmp_path / "killed"
    p = subprocess.Popen(cmd(run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and p.poll() is None:
        if (run / "LATEST").exists() and max(_losses(run), default=0) >= 4:
            break
        time.sleep(0.05)
    assert p.poll() is None, "the job ended before it could be killed"
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert max(_losses(run)) < steps
    proc = subprocess.run(cmd(run), env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _losses(run) == reference  # bit-identical floats

    out = tmp_path / "hf"
    from transformers import AutoModelForCausalLM

    from dtorch.checkpoint.export import load_full_state_dict
    from dtorch.checkpoint.hf_weights import load_model_config
    from dtorch.cli import main  # `dtorch ckpt export`, in this process: no new interpreter to start
    from dtorch.models import build_from_config

    assert main(["ckpt", "export", str(run), str(out), "--hf"]) == 0
    latest = run / (run / "LATEST").read_text().strip()
    model = build_from_config(load_model_config(gpt2_dir)[1])
    model.load_state_dict(load_full_state_dict(latest)["model"])
    x = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(x)
        got = AutoModelForCausalLM.from_pretrained(out).eval()(x).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_cli_tokenizer_larger_than_the_model_is_one_line_exit_2(corpus, tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "dtorch.cli", "train", "--model", "gpt:layers=1,hidden=32,heads=2,"
                           "vocab=256,seq=64", "--data", str(corpus["jsonl"]), "--tokenizer", str(corpus["big"]),
                           "--nproc", "2", "--checkpoint-dir", str(tmp_path / "run")],
                          env=_env(tmp_path / "cache"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "vocabulary of" in lines[0], proc.stderr
