"""`dtorch train`: the main job. With no arguments it trains a small GPT on this machine's default
corpus, on all local GPUs or else 2 CPU worker processes, auto-planned and checkpointed, and
prints generated text at the end. Run it again and it resumes."""

from __future__ import annotations

import argparse
import os


def add_parser(sub, help_text: str) -> None:
    from dtorch.train.job import add_arguments

    p = sub.add_parser("train", help=help_text, description=__doc__)
    add_arguments(p)
    p.add_argument("--nproc", type=int, default=None,
                   help="worker processes (default: the number of local GPUs, else 2 on CPU)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts after a failure (default 3)")
    p.add_argument("--chaos", default="", help="fault-injection drill, e.g. kill:rank=1:step=40 (see docs)")
    p.set_defaults(func=run)


def _check_inputs(args: argparse.Namespace) -> None:
    """The checks a worker would fail on, run once here: an unknown architecture, a checkpoint whose
    shapes do not match its config (naming the tensor), a tokenizer larger than the model's vocabulary."""
    from dtorch.models import build_from_config, model_config
    from dtorch.parallel.parallelize import meta_model

    vocab = None
    if args.init_from:
        from dtorch.checkpoint.hf_weights import HFWeights, model_shapes

        weights = HFWeights(args.init_from)
        config = weights.config if not weights.seed else model_config(args.model)
        weights.check(model_shapes(meta_model(lambda: build_from_config(config))))
        vocab = config.vocab_size
    if args.tokenizer:
        from dtorch.errors import ConfigError
        from dtorch.train.tokenize import Tokenizer

        tok = Tokenizer(args.tokenizer)
        if vocab is None:
            vocab = _spec_vocab(args.model)
        if tok.vocab_size > vocab:
            raise ConfigError("tokenizer", f"vocabulary of {tok.vocab_size} tokens",
                              f"the model's embedding has {vocab} rows; use a tokenizer with at most that many "
                              "tokens or a model with a larger vocab_size")


def _spec_vocab(spec: str) -> int:
    from dtorch.models import model_config

    return model_config(spec).vocab_size


def run(args: argparse.Namespace) -> int:
    from dtorch.cluster.local import default_workers
    from dtorch.errors import ConfigError

    nproc = args.nproc or default_workers()
    if nproc < 1:
        raise ConfigError("nproc", nproc, "use at least 1 worker process")
    if args.data and not args.tokenizer:
        from pathlib import Path

        from dtorch.train.tokenize import SUFFIXES

        if Path(args.data).is_dir() or Path(args.data).suffix in SUFFIXES:
            raise ConfigError("data", args.data, "text needs a tokenizer: add --tokenizer path/to/tokenizer.json")
    if os.environ.get("RANK") is None and (args.init_from or args.tokenizer):
        _check_inputs(args)  # bad checkpoint / tokenizer: one line, exit 2, before any worker starts
    if os.environ.get("RANK") is not None or (nproc == 1 and not args.chaos):
        from dtorch.train.job import run as run_job

        return run_job(args)
    from dtorch.elastic.launch import LaunchSpec, launch

    forwarded = []
    for action_dest, flag in (("model", "--model"), ("steps", "--steps"), ("global_batch", "--global-batch"),
                              ("seq_len", "--seq-len"), ("lr", "--lr"), ("warmup", "--warmup"),
                              ("checkpoint_dir", "--checkpoint-dir"), ("checkpoint_every", "--checkpoint-every"),
                              ("plan", "--plan"), ("seed", "--seed"), ("data", "--data"),
                              ("tokenizer", "--tokenizer"), ("init_from", "--init-from"),
                              ("sample_tokens", "--sample-tokens")):
        value = getattr(args, action_dest)
        if value is not None:
            forwarded += [flag, str(value)]
    if args.no_progress:
        forwarded.append("--no-progress")
    spec = LaunchSpec(nproc_per_node=nproc, max_restarts=args.max_restarts, chaos=args.chaos)
    return launch(spec, "dtorch.train.job", forwarded, module=True)
