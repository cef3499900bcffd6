"""The main job: a small GPT trained on the default corpus of this machine, end to end.

`dtorch train` launches this module on every worker (under the elastic agent), or runs it in
process for a single worker. Each worker builds the same `Trainer`; rank 0 prints a sample of
generated text at the end.
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_MODEL = "gpt:layers=4,hidden=128,heads=4,vocab=256,seq=256"


def _grad_norm(value: float) -> float | None:
    from dtorch.errors import ConfigError

    if value < 0 or value != value:
        raise ConfigError("max_grad_norm", value, "use a positive norm, or 0 for no clipping")
    return value or None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Training flags shared by `dtorch train` and the worker entry point."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="model preset or spec (gpt:..., llama:...); default: a 4-layer byte-level GPT")
    p.add_argument("--steps", type=int, default=300, help="train until this global step (default 300)")
    p.add_argument("--global-batch", type=int, default=16, help="samples per optimizer step (default 16)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps (default 20)")
    p.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="clip the gradient norm to this (default 1.0; 0 = no clipping, which lets an offloaded "
                        "optimizer step each block during the backward: docs/memory-tiers.md)")
    p.add_argument("--checkpoint-dir", default="runs/train", help="checkpoints; the run resumes from here")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints (default 50)")
    p.add_argument("--plan", default="auto",
                   help="auto | a plan JSON/YAML file | fixed fields like tp=2,ac=full (the rest is searched)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None,
                   help="a token file (uint16 .bin), or with --tokenizer text: .txt/.md/.jsonl/.parquet files or a "
                        "directory of them (tokenised once, cached); default: the stdlib byte corpus")
    p.add_argument("--tokenizer", default=None,
                   help="a Hugging Face tokenizer.json (or its directory) to tokenise --data with")
    p.add_argument("--init-from", default=None,
                   help="a Hugging Face model directory (config.json + safetensors; Llama 3, Mistral, Qwen2, "
                        "GPT-2): start from its weights; the model is built from its config.json")
    p.add_argument("--sample-tokens", type=int, default=200, help="tokens of text to generate at the end")
    p.add_argument("--no-progress", action="store_true", help="no console progress line")
    p.add_argument("--monitor-port", type=int, default=None,
                   help="serve Prometheus /metrics and the live page on rank 0 at 127.0.0.1:PORT (0 = a free "
                        "port; see docs/monitoring.md for another interface)")
    p.add_argument("--trace-comms", action="store_true",
                   help="record every collective per rank to <checkpoint-dir>/comms-rank<r>.jsonl (slow; for debugging)")
    p.add_argument("--offload", default=None, choices=("none", "optimizer", "optimizer_nvme"),
                   help="optimizer state and fp32 masters in host memory (optimizer) or in files in --offload-dir "
                        "(optimizer_nvme), the step on the CPU; default: what the plan says (docs/memory-tiers.md)")
    p.add_argument("--offload-dir", default=None, help="directory on a local disk for --offload optimizer_nvme")
    p.add_argument("--rebalance", action="store_true",
                   help="straggler response: when a rank is persistently slow, re-cut the data-parallel shares by "
                        "measured speed at the next checkpoint (docs/monitoring.md)")
    p.add_argument("--metrics-every", type=int, default=None,
                   help="gather every rank's step-time terms and memory every N steps (default 10; 0 = off)")


def parse_plan(text: str):
    """'auto', a file path, or 'k=v,k=v' fixed fields (ints/bools/strings)."""
    if text == "auto":
        return "auto"
    if "=" not in text:
        return text
    from dtorch.plan.search import parse_fix

    return parse_fix(text)


def run(args: argparse.Namespace) -> int:
    import torch

    from dtorch.errors import ConfigError
    from dtorch.models import build_model
    from dtorch.train.optim import AdamW, WarmupCosine
    from dtorch.train.trainer import Trainer

    data = None
    if args.tokenizer and not args.data:
        raise ConfigError("tokenizer", args.tokenizer, "a tokenizer needs text to tokenise: pass --data too")
    if args.data and args.tokenizer:
        from dtorch.train.tokenize import text_dataset

        data = text_dataset(args.data, args.tokenizer, args.seq_len)
    elif args.data:
        from pathlib import Path

        from dtorch.train.data import TokenFile
        from dtorch.train.tokenize import SUFFIXES

        if Path(args.data).is_dir() or Path(args.data).suffix in SUFFIXES:
            raise ConfigError("data", args.data, "text needs a tokenizer: add --tokenizer path/to/tokenizer.json")

        data = TokenFile(args.data, args.seq_len)
    init_from = getattr(args, "init_from", None)
    from pathlib import Path

    from dtorch.checkpoint.hf_weights import SEED_MARKER

    seed_ckpt = bool(init_from) and (Path(init_from) / SEED_MARKER).is_file()
    # a Hugging Face directory brings its own model (config.json); a seed checkpoint needs --model
    make_model = (lambda: build_model(args.model)) if not init_from or seed_ckpt else None
    trainer = Trainer(
        model=make_model,
        init_from=init_from,
        data=data,
        optimizer=AdamW(lr=args.lr, weight_decay=0.0),
        lr_schedule=WarmupCosine(warmup_steps=args.warmup),
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        plan=parse_plan(args.plan),
        seed=args.seed,
        console=not args.no_progress,
        monitor_port=getattr(args, "monitor_port", None),
        metrics_every=getattr(args, "metrics_every", None),
        trace_comms=True if getattr(args, "trace_comms", False) else None,
        offload=getattr(args, "offload", None),
        offload_dir=getattr(args, "offload_dir", None),
        rebalance=getattr(args, "rebalance", False),
        max_grad_norm=_grad_norm(getattr(args, "max_grad_norm", 1.0)),
    )
    result = trainer.fit(steps=args.steps)
    full = trainer.full_state_dict() if args.sample_tokens > 0 else None
    if trainer.rank == 0:
        summary = {"final_step": result.final_step, "steps_run": result.steps_run,
                   "resumed_from": result.resumed_from, "plan": trainer.plan.describe(),
                   "final_loss": result.losses.get(result.final_step), "wall_s": round(result.wall_s, 2)}
        print("dtorch: " + json.dumps(summary), flush=True)
        if full is not None:
            from dtorch.train.data import ByteTokenizer
            from dtorch.train.generate import generate

            model = trainer.model_factory()
            model.load_state_dict(full)
            tok = getattr(data, "tokenizer", None) or ByteTokenizer()
            prompt = torch.tensor(tok.encode("def "), dtype=torch.long)
            out = generate(model, prompt, args.sample_tokens, context=args.seq_len, seed=args.seed)
            print("---- generated text ----\n" + tok.decode(out) + "\n------------------------", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtorch.train.job")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
