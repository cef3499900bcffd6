"""Your own training script: a plain `dtorch.Trainer`, launched by `dtorch run` (torchrun's flags)
or by `python examples/train.py` on one process. The docs' `dtorch run` and drill examples run it.

    dtorch run --nproc-per-node 2 examples/train.py --steps 20
    dtorch run --nproc-per-node 2 --chaos kill:rank=1:step=5 examples/train.py

Every rank runs this file; the Trainer finds its rank and world from the launcher, plans for the
world it sees and resumes from `--checkpoint-dir` after a restart.
"""

import argparse

import dtorch
from dtorch.models import build_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="train until this global step")
    p.add_argument("--checkpoint-dir", default="runs/example", help="checkpoints; a rerun resumes here")
    p.add_argument("--lr", type=float, default=3e-3)
    a = p.parse_args()
    trainer = dtorch.Trainer(
        model=lambda: build_model("gpt-tiny"),     # any nn.Module factory, built on the meta device
        data=None,                                 # the built-in byte corpus; any map-style dataset
        optimizer=dtorch.optim.AdamW(lr=a.lr),
        global_batch=4, seq_len=32,
        checkpoint_dir=a.checkpoint_dir, checkpoint_every=4,
    )
    result = trainer.fit(steps=a.steps)
    if trainer.env.rank in (0, None):  # one line per job, not per rank
        loss = result.losses.get(result.final_step)
        print(f"finished at step {result.final_step}" + (f", loss {loss:.3f}" if loss is not None else ""))


if __name__ == "__main__":
    main()
