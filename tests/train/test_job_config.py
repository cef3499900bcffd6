"""One typed job configuration: `dtorch train` fills a `JobConfig` from its flags (one flag per
field) and every worker receives it whole, so no option is silently dropped on the way to the
workers. The end-to-end test sets every option of `dtorch train` at `--nproc 2` and compares what
each worker received with what argparse parsed."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from dtorch.errors import ConfigError
from dtorch.train.job import JobConfig, add_arguments

TINY = "gpt:layers=1,hidden=32,heads=2,vocab=256,seq=64"


def _train_parser() -> argparse.ArgumentParser:
    from dtorch.cli import build_parser

    parser = build_parser(["train"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _dests(p: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in p._actions if a.dest not in ("help",)}


def test_every_flag_of_dtorch_train_is_a_job_config_field_and_back():
    fields = {f.name for f in dataclasses.fields(JobConfig)}
    assert _dests(_train_parser()) == fields | {"config", "print_config"}  # the job description file's two
    worker = argparse.ArgumentParser()
    add_arguments(worker)  # the worker entry point: the trainer's flags only
    assert _dests(worker) == {f.name for f in dataclasses.fields(JobConfig) if not f.metadata["launcher"]}


def test_config_round_trips_through_a_private_file_and_refuses_what_it_does_not_know(tmp_path):
    c = JobConfig(max_grad_norm=0.05, offload="optimizer", offload_dir="/x", nproc=2, rebalance=True)
    path = c.save(tmp_path / "run")
    assert JobConfig.load(path) == c
    assert os.stat(tmp_path / "run").st_mode & 0o777 == 0o700 and os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(ConfigError, match="does not know"):
        JobConfig.from_dict({**c.to_dict(), "max_grad_nrom": 1.0})
    with pytest.raises(ConfigError, match="max_grad_norm"):
        JobConfig.from_dict({**c.to_dict(), "max_grad_norm": "0.05"})
    (tmp_path / "run" / "job.json").unlink()
    (tmp_path / "run" / "job.json").symlink_to(tmp_path / "elsewhere.json")
    c.save(tmp_path / "run")  # the link is replaced, never written through
    assert not (tmp_path / "elsewhere.json").exists() and not (tmp_path / "run" / "job.json").is_symlink()


def test_worker_entry_refuses_flags_beside_a_config(tmp_path):
    from dtorch.train.job import main

    path = JobConfig().save(tmp_path / "run")
    with pytest.raises(ConfigError, match="also given: steps"):
        main(["--config", str(path), "--steps", "5"])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """A text corpus with its tokenizer and a seed checkpoint of the tiny model: every input option
    of `dtorch train` gets a real value."""
    from tokenizers import Tokenizer as Tok
    from tokenizers import models, pre_tokenizers, trainers

    from dtorch.checkpoint.hf_weights import write_seed_checkpoint
    from dtorch.models import build_model

    root = tmp_path_factory.mktemp("inputs")
    docs = [" ".join(["alpha beta gamma delta"] * (3 + i % 7)) + f" {i}." for i in range(200)]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=120, special_tokens=["<|endoftext|>"]))
    tok.save(str(root / "tok.json"))
    write_seed_checkpoint(build_model(TINY), root / "seed")
    return {"data": str(root / "corpus.jsonl"), "tokenizer": str(root / "tok.json"), "seed": str(root / "seed")}


@pytest.mark.slow
def test_every_dtorch_train_option_reaches_both_workers(inputs, tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    (tmp_path / "offload").mkdir()
    # every option, none at its default (a flag added later without a value here fails below)
    values = {
        "model": TINY, "steps": "2", "global_batch": "4", "seq_len": "16", "lr": "0.002", "warmup": "1",
        "max_grad_norm": "0.05", "checkpoint_dir": str(ckpt), "checkpoint_every": "1", "plan": "dp_shard=2",
        "seed": "3", "data": inputs["data"], "tokenizer": inputs["tokenizer"], "init_from": inputs["seed"],
        "sample_tokens": "3", "no_progress": None, "monitor_port": "0", "trace_comms": None,
        "offload": "optimizer_nvme", "offload_dir": str(tmp_path / "offload"), "rebalance": None,
        "metrics_every": "1", "nproc": "2", "max_restarts": "0", "chaos": "slow:rank=1:factor=1.01:step=1000",
        "heartbeat_timeout": "45", "run_dir": str(run_dir), "snapshot_every": "2",
        "lr_schedule": "wsd", "lr_min_factor": "0.05", "lr_decay_ratio": "0.5",
        "eval_every": "1", "eval_data": inputs["data"], "eval_batches": "1",
        "tensorboard": None, "wandb": "dtorch-test",
    }
    parser = _train_parser()
    # eval_split excludes eval_data (the held-out split is tests/train/test_eval.py's)
    assert set(values) | {"eval_split", "config", "print_config"} == _dests(parser), "set a non-default value for every option of dtorch train"
    argv = []
    for dest, v in values.items():
        argv += ["--" + dest.replace("_", "-")] + ([v] if v is not None else [])
    ns = vars(parser.parse_args(argv))
    defaults = {f.name: f.default for f in dataclasses.fields(JobConfig)}
    assert all(ns[d] != defaults[d] for d in values), [d for d in values if ns[d] == defaults[d]]

    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTORCH_NO_CALIBRATION": "1", "DTORCH_CACHE": str(tmp_path / "cache"),
           "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    p = subprocess.run([sys.executable, "-m", "dtorch.cli", "train", *argv], env=env, capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    seen = {e["rank"]: e["config"] for e in (json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines())
            if e["kind"] == "job_config"}
    assert sorted(seen) == [0, 1]
    for rank, config in seen.items():
        for dest in values:
            assert config[dest] == ns[dest], (rank, dest, config[dest], ns[dest])
    # and the options the workers used to drop took effect: the NVMe optimizer tier in --offload-dir
    records = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines()]
    offload = [r for r in records if r.get("event") == "offload"]
    assert offload and offload[0]["tier"] == "nvme" and offload[0]["directory"] == str(tmp_path / "offload")
    assert [r["step"] for r in records if "loss" in r and "event" not in r] == [1, 2]
    assert [r["step"] for r in records if r.get("event") == "eval"] == [1, 2]  # --eval-every 1, and at the end
    # the sinks (rank 0): TensorBoard's event file, one offline W&B run (tests/train/test_sinks.py reads them)
    assert list((ckpt / "tb").glob("events.out.tfevents.*"))
    assert len(list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
