"""`dtorch train`: the main job. With no arguments it trains a small GPT on this machine's default
corpus, on all local GPUs or else 2 CPU worker processes, auto-planned and checkpointed, and
prints generated text at the end. Run it again and it resumes.

Inputs are checked here, before any worker or process group exists (`preflight`): a mistake
ends the command at once with one line and exit code 2 instead of being retried by the elastic
agent. What can only be found inside a worker (an incompatible checkpoint) ends the job the same
way (see `dtorch.elastic.bootstrap.is_fatal`).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from dtorch.env import current

if TYPE_CHECKING:
    from dtorch.train.job import JobConfig


def add_parser(sub, help_text: str) -> None:
    from dtorch.train.job import add_arguments

    p = sub.add_parser("train", help=help_text, description=__doc__)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a job description (.toml, .yaml or .yml; the format follows the extension) whose fields "
                        "are these options' names with underscores; a flag given here overrides the file")
    p.add_argument("--print-config", nargs="?", const="auto", default=None, choices=("auto", "toml", "yaml"),
                   help="write the resolved job description (defaults, --config, flags) to stdout and exit "
                        "without training: TOML, or the --config file's format; feed it back with --config")
    add_arguments(p, launcher=True)  # one flag per JobConfig field: the workers receive the config whole
    p.set_defaults(func=run)


def _check_inputs(args: JobConfig) -> None:
    """The checks a worker would fail on, run once here: an unknown architecture, a checkpoint whose
    shapes do not match its config (naming the tensor), a tokenizer larger than the model's vocabulary."""
    from dtorch.models import build_from_config, model_config
    from dtorch.parallel.parallelize import meta_model

    vocab = None
    if args.init_from:
        from dtorch.checkpoint.hf_weights import HFWeights, check_window, model_shapes, read_config

        weights = HFWeights(args.init_from)
        config = weights.config if not weights.seed else model_config(args.model)
        weights.check(model_shapes(meta_model(lambda: build_from_config(config))))
        if not weights.seed:  # a sliding window shorter than the sequence: the reference model ignores it
            check_window(read_config(args.init_from), args.seq_len)
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
    from dtorch.model import spec_vocab

    return spec_vocab(spec)


def _same_model(a: str, b: str) -> bool:
    from dtorch.models.configs import model_config

    if a == b:
        return True
    try:
        return model_config(a) == model_config(b)
    except Exception:  # a preset or spec this build cannot parse: compare as written
        return False


def _model_factory(args: JobConfig):
    """What the workers build: the Hugging Face checkpoint's architecture with --init-from (unless it is
    a seed checkpoint of --model), else --model (a preset, spec or Hugging Face config.json)."""
    from dtorch.model import model_factory_of
    from dtorch.models import build_from_config

    if args.init_from:
        from dtorch.checkpoint.hf_weights import HFWeights

        weights = HFWeights(args.init_from)
        if not weights.seed:
            return lambda: build_from_config(weights.config)
    return model_factory_of(args.model)


def preflight(args: JobConfig, nproc: int) -> None:
    """Check every input of the job that can be checked without a process group; raises
    ConfigError naming the first problem."""
    from dtorch.errors import ConfigError

    for name, flag in (("steps", "--steps"), ("global_batch", "--global-batch"), ("seq_len", "--seq-len"),
                       ("checkpoint_every", "--checkpoint-every")):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(name, value, f"use a positive {flag}")
    if args.max_restarts < 0:
        raise ConfigError("max_restarts", args.max_restarts, "use 0 or more")
    from dtorch.train.job import _grad_norm

    _grad_norm(args.max_grad_norm)
    if args.snapshot_every < 0:
        raise ConfigError("snapshot_every", args.snapshot_every, "use steps >= 1, or 0 for no snapshots")
    if args.heartbeat_timeout < 0:
        raise ConfigError("heartbeat_timeout", args.heartbeat_timeout, "use seconds > 0, or 0 to disable")
    if args.data and not args.tokenizer:
        from dtorch.train.data import TokenFile

        TokenFile(args.data, args.seq_len)  # exists, whole tokens, long enough
    elif args.data and not os.path.exists(args.data):  # text, tokenised by the workers: at least there
        raise ConfigError("data", args.data, "no such file or directory")
    _check_checkpoint_dir(args.checkpoint_dir)
    if args.monitor_port:  # found here, not as an error in rank 0 that every restart meets again
        from dtorch.monitor.server import check_port

        check_port(args.monitor_port)
    _check_plan(args, nproc)
    _check_checkpoint_model(args)


def _check_checkpoint_model(args: JobConfig) -> None:
    """The newest checkpoint's model shapes (DCP metadata, read with the allow-list) against the
    model asked for: resuming another model's checkpoint fails here, not in every worker."""
    from pathlib import Path

    from dtorch.checkpoint import files as F
    from dtorch.checkpoint import safe
    from dtorch.errors import ConfigError
    from dtorch.parallel.parallelize import meta_model

    for _, path in F.committed_dirs(Path(args.checkpoint_dir)):
        try:
            F.read_manifest(path)
            saved = safe.load_metadata(path / ".metadata").state_dict_metadata
        except (F.ManifestError, safe.UnsafeMetadata, OSError):
            continue  # damaged: the workers skip it with a warning and fall back
        mine = {f"model.{k}": tuple(v.shape) for k, v in meta_model(_model_factory(args)).state_dict().items()}
        shared = [k for k in mine if k in saved and hasattr(saved[k], "size")]
        bad = [k for k in shared if tuple(saved[k].size) != mine[k]]
        if bad or not shared:
            what = (f"{bad[0][6:]} is {tuple(saved[bad[0]].size)} there, {mine[bad[0]]} in --model {args.model}"
                    if bad else f"none of the parameters of --model {args.model} are in it")
            raise ConfigError("checkpoint_dir", str(path), f"a checkpoint of another model ({what}); resume with the "
                              "model it was written with, or use another --checkpoint-dir")
        return


def _check_checkpoint_dir(path: str) -> None:
    import errno
    import tempfile

    from dtorch import trust
    from dtorch.errors import ConfigError

    d = os.path.abspath(path)
    existing = d
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    trust.check_dir(d, "checkpoint_dir")
    try:  # a real write: as root, os.access says yes even on a read-only filesystem
        fd, probe = tempfile.mkstemp(prefix=".dtorch-write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        what = "is on a read-only filesystem" if e.errno == errno.EROFS else f"is not writable ({e.strerror})"
        raise ConfigError("checkpoint_dir", path, f"{existing} {what}; pass a writable --checkpoint-dir") from None


def _check_plan(args: JobConfig, nproc: int) -> None:
    """The plan the workers would choose, chosen here for a world of `nproc` (same code path)."""
    from dtorch.errors import ConfigError
    from dtorch.plan.plan import Plan
    from dtorch.train.job import parse_plan
    from dtorch.train.trainer import Trainer

    request = parse_plan(args.plan)
    if isinstance(request, str) and request != "auto":
        plan = Plan.load(request)
        if plan.model and not _same_model(plan.model, args.model):
            raise ConfigError("plan", request, f"it was made for model {plan.model!r}, not {args.model!r}; "
                              f"make a plan for this model (dtorch plan {args.model} ... --out FILE) or pass --model {plan.model}")
    trainer = Trainer(model=_model_factory(args), global_batch=args.global_batch, seq_len=args.seq_len,
                      checkpoint_dir=None, checkpoint_every=args.checkpoint_every, plan=request, seed=args.seed,
                      console=False)
    trainer.ckpt = None
    plan = trainer._choose_plan(nproc, 0)
    from dtorch.plan.strategies import check_executable

    check_executable(plan)  # a plan file this executor refuses (e.g. ZeRO-2 under zero_bubble): here, not in every worker
    from dtorch.train.offload import OptimizerOffload

    # the tier the workers would resolve, here: a missing --offload-dir fails before any worker starts
    OptimizerOffload.resolve(args.offload, plan.offload, args.offload_dir)


def _starts_workers(args: argparse.Namespace) -> bool:
    """Whether this command will start worker processes, read without importing torch so that
    their forkserver can start first (a wrong guess costs time, never correctness)."""
    if args.print_config or current().launched:
        return False
    from dtorch.cluster.local import default_workers
    from dtorch.train.config import read
    from dtorch.train.job import JobConfig

    try:
        doc = read(args.config, JobConfig) if args.config else {}
    except Exception:  # noqa: BLE001 - the checks below name a bad file properly
        return False
    nproc = getattr(args, "nproc", doc.get("nproc"))
    return _launches(default_workers() if nproc is None else nproc, getattr(args, "chaos", doc.get("chaos")))


def _launches(nproc: int, chaos: str | None) -> bool:
    """Whether a job of `nproc` workers runs under the elastic agent rather than in this process:
    several workers, or one with a chaos fault (whose recovery needs the agent)."""
    return nproc > 1 or (nproc == 1 and bool(chaos))


def run(args: argparse.Namespace) -> int:
    from dtorch.elastic.bootstrap import TRAINER_PRELOAD, early_forkserver

    with early_forkserver(_starts_workers(args), TRAINER_PRELOAD):  # its imports beside our checks and plan
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from dtorch.cluster.local import default_workers
    from dtorch.errors import ConfigError
    from dtorch.train.config import FORMATS, dumps
    from dtorch.train.job import from_command_line

    config = from_command_line(args)  # defaults < --config file < flags given
    if args.print_config:
        kind = args.print_config
        if kind == "auto":
            kind = FORMATS.get(os.path.splitext(args.config or "")[1].lower(), "toml")
        print(dumps(config, "toml" if kind == "json" else kind), end="")
        return 0
    nproc = config.nproc if config.nproc is not None else default_workers()
    if nproc < 1:
        raise ConfigError("nproc", nproc, "use at least 1 worker process")
    if config.data and not config.tokenizer:
        from pathlib import Path

        from dtorch.train.tokenize import SUFFIXES

        if Path(config.data).is_dir() or Path(config.data).suffix in SUFFIXES:
            raise ConfigError("data", config.data, "text needs a tokenizer: add --tokenizer path/to/tokenizer.json")
    launched = current().launched
    if not launched:
        if config.init_from or config.tokenizer:
            _check_inputs(config)  # bad checkpoint / tokenizer: one line, exit 2, before any worker starts
        preflight(config, nproc)
    if launched or not _launches(nproc, config.chaos):
        from dtorch.train.job import run as run_job

        return run_job(config)
    from dtorch.elastic.bootstrap import TRAINER_PRELOAD
    from dtorch.elastic.launch import LaunchSpec, launch

    spec = LaunchSpec(nproc_per_node=nproc, max_restarts=config.max_restarts, chaos=config.chaos,
                      heartbeat_timeout=config.heartbeat_timeout, snapshot_every=config.snapshot_every,
                      run_dir=config.run_dir, preload=TRAINER_PRELOAD)
    # the whole configuration, in the job's private run directory: no flag to forward one by one
    path = config.save(spec.run_dir)  # type: ignore[arg-type]
    return launch(spec, "dtorch.train.job", ["--config", str(path)], module=True)
