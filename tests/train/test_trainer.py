"""The trainer end to end: real `dtorch train` jobs (elastic agent, gloo workers, real files)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtorch.errors import ConfigError
from dtorch.plan.plan import Plan

MODEL = "gpt-tiny"
COMMON = ["--model", MODEL, "--seq-len", "32", "--global-batch", "8", "--lr", "3e-3", "--warmup", "3",
          "--sample-tokens", "0", "--no-progress"]


def _train_cmd(ckpt: Path, steps: int, nproc: int, plan: str = "auto", every: int = 3) -> list[str]:
    return [sys.executable, "-m", "dtorch.cli", "train", *COMMON, "--nproc", str(nproc), "--steps", str(steps),
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(every), "--plan", plan]


def _env() -> dict[str, str]:
    # no stored calibration: every "auto" run of a test plans the same way
    return {**os.environ, "DTORCH_RECORD_SAMPLES": "1", "OMP_NUM_THREADS": "1", "DTORCH_NO_CALIBRATION": "1"}


def _run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _losses(log_dir: Path) -> dict[int, float]:
    """Per-step loss; a step re-run after a resume overwrites the record of the killed attempt."""
    out: dict[int, float] = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "step" in rec and "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def _global_samples(log_dir: Path) -> dict[int, list[int]]:
    """Global sample order per step, reassembled from every rank's audit log (dp ranks in order)."""
    per_step: dict[int, dict[int, list[int]]] = {}
    for f in log_dir.glob("samples-rank*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            per_step.setdefault(rec["step"], {})[rec["dp_rank"]] = rec["indices"]
    return {s: [i for r in sorted(d) for i in d[r]] for s, d in per_step.items()}


def _summary(out: subprocess.CompletedProcess) -> dict:
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("dtorch: {"))
    return json.loads(line.removeprefix("dtorch: "))


def _leftovers(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd:
            found.append(f"{pid}: {cmd[:120]}")
    return found


@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    steps = 10
    ref = tmp_path / "reference"
    _run(_train_cmd(ref, steps, nproc=2))
    reference = _losses(ref)
    assert sorted(reference) == list(range(1, steps + 1))

    run = tmp_path / "killed"
    kill_at = random.Random(os.getpid()).randint(4, 8)
    proc = subprocess.Popen(_train_cmd(run, steps, nproc=2), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        # kill at a random step after the first checkpoint committed (before it, a rerun starts over)
        if (run / "LATEST").exists() and max(_losses(run), default=0) >= kill_at:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the job ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the whole job: agent and workers
    proc.wait()
    time.sleep(0.5)
    assert _leftovers(str(run)) == []
    done_before = max(_losses(run))
    assert done_before < steps

    out = _run(_train_cmd(run, steps, nproc=2))
    assert 0 < (_summary(out)["resumed_from"] or 0) <= done_before
    resumed = _losses(run)
    # bit-identical: the same float, not just close
    assert resumed == reference, f"killed at step {done_before}: {resumed} != {reference}"
    assert _global_samples(run) == _global_samples(ref)
    assert _leftovers(str(run)) == []


@pytest.mark.slow
def test_resume_at_other_world_size_keeps_sample_order_and_loss(tmp_path):
    ref = tmp_path / "w4"
    # FSDP x TP at world size 4; checkpoints at 4 and 8 (resumed from 4: past the 3 warm-up steps)
    _run(_train_cmd(ref, 8, nproc=4, plan="dp_shard=2,tp=2", every=4))
    reference = _losses(ref)
    ref_samples = _global_samples(ref)
    assert sorted(reference) == list(range(1, 9))

    for nproc, plan in ((2, "dp_shard=2"), (1, "auto")):
        run = tmp_path / f"w{nproc}"
        shutil.copytree(ref, run, ignore=shutil.ignore_patterns("step-00000008*", "metrics.jsonl", "samples-*"))
        (run / "LATEST").write_text("step-00000004")
        out = _run(_train_cmd(run, 8, nproc=nproc, plan=plan, every=4))
        assert _summary(out)["resumed_from"] == 4
        losses = _losses(run)
        assert sorted(losses) == list(range(5, 9))
        for step, loss in losses.items():
            assert abs(loss - reference[step]) <= 0.01 * abs(reference[step]), (nproc, step, loss, reference[step])
        samples = _global_samples(run)
        assert samples == {s: ref_samples[s] for s in range(5, 9)}, f"world {nproc}: sample order changed"


def test_single_process_resume_is_bit_identical(tmp_path):
    from dtorch.models import build_model
    from dtorch.train import Trainer

    def fit(ckpt: Path, steps: int) -> dict[int, float]:
        trainer = Trainer(model=lambda: build_model(MODEL), global_batch=4, seq_len=16, checkpoint_dir=ckpt,
                          checkpoint_every=2, plan=Plan(), console=False)
        return trainer.fit(steps=steps).losses

    straight = fit(tmp_path / "a", 6)
    first = fit(tmp_path / "b", 3)
    rest = fit(tmp_path / "b", 6)
    assert {**first, **rest} == straight
    assert sorted(rest) == [4, 5, 6]


def test_plan_that_disagrees_with_global_batch_is_rejected_before_training(tmp_path):
    from dtorch.models import build_model
    from dtorch.train import Trainer

    trainer = Trainer(model=lambda: build_model(MODEL), global_batch=6, seq_len=16, checkpoint_dir=tmp_path,
                      plan=Plan(microbatch_size=4, num_microbatches=1, global_batch=4), console=False)
    with pytest.raises(ConfigError, match="global_batch"):
        trainer.fit(steps=2)
    assert not list(tmp_path.glob("step-*"))


def test_bad_trainer_arguments_name_the_field():
    from dtorch.train import Trainer

    with pytest.raises(ConfigError, match="global_batch"):
        Trainer(model=lambda: None, global_batch=0)
    with pytest.raises(ConfigError, match="checkpoint_every"):
        Trainer(model=lambda: None, checkpoint_every=0)


def test_checkpointing_does_not_change_the_numerics(tmp_path):
    from dtorch.models import build_model
    from dtorch.train import Trainer

    def fit(ckpt: Path | None) -> dict[int, float]:
        trainer = Trainer(model=lambda: build_model(MODEL), global_batch=4, seq_len=16, checkpoint_dir=ckpt,
                          checkpoint_every=1, plan=Plan(), console=False)
        return trainer.fit(steps=4).losses

    # reading an optimizer's state dict before its first step would run a zero-lr step and shift
    # Adam's bias correction: saving (and staging for async saves) must leave training untouched
    assert fit(tmp_path / "ckpt") == fit(None)


def test_restart_within_a_job_keeps_the_plan_its_first_start_found(tmp_path, monkeypatch):
    """A worker restarted by `dtorch run` (same run directory, same world size) reuses the plan the
    job agreed on instead of searching again (~0.3 s of a recovery); after an out-of-memory error at
    that world size it plans again."""
    from dtorch.models import build_model
    from dtorch.monitor import oom
    from dtorch.train import Trainer

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("DTORCH_RUN_DIR", str(run_dir))

    def doc(**kw):
        t = Trainer(model=lambda: build_model(MODEL), global_batch=4, seq_len=16, console=False,
                    log_dir=tmp_path / "logs", **kw)
        t.rank, t.world, t.ckpt = 0, 1, None
        return t._plan_doc()

    first = doc()
    assert first["flops_per_token"] > 0 and first["profiled"] and len(list(run_dir.glob("plan-world1-*.json"))) == 1

    def no_search(*a, **k):
        raise AssertionError("searched again")

    from dtorch.train.resolve import PlanResolver

    monkeypatch.setattr(PlanResolver, "search", no_search)
    again = doc()
    assert not again.get("profiled")  # nobody profiles for a reused plan
    assert (again["plan"], again["flops_per_token"]) == (first["plan"], first["flops_per_token"])
    with pytest.raises(AssertionError, match="searched again"):  # another request is another plan
        doc(plan={"microbatch_size": 2})
    oom.record({"world_size": 1, "budget_bytes": 2**30, "plan": Plan.from_dict(first["plan"]).describe()},
               tmp_path / "logs")
    with pytest.raises(AssertionError, match="searched again"):
        doc()


@pytest.mark.slow
def test_moe_trains_with_expert_parallelism_and_resumes_exactly(tmp_path):
    """`dtorch train --model moe-tiny --plan ep=2` at world 2 runs the planned EP plan (FSDP or DDP x EP), and
    a run stopped at step 2 and resumed from its checkpoint (EP-sharded experts saved and loaded)
    computes step 3's loss exactly as the uninterrupted run: the weights after step 2 came back.
    (Step 4 differs legitimately: the learning-rate schedule spans --steps, 2 in the first leg.)
    Three 2-process runs, about 35 s wall on the shared 2-core machine."""
    def cmd(ckpt: Path, steps: int) -> list[str]:
        return [sys.executable, "-m", "dtorch.cli", "train", "--model", "moe-tiny", "--seq-len", "16",
                "--global-batch", "8", "--lr", "3e-3", "--warmup", "1", "--sample-tokens", "0", "--no-progress",
                "--nproc", "2", "--steps", str(steps), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                "--plan", "ep=2"]

    ref = tmp_path / "ref"
    out = _summary(_run(cmd(ref, 4)))
    assert "ep=2" in out["plan"] and out["final_step"] == 4
    run = tmp_path / "run"
    _run(cmd(run, 2))
    resumed = _summary(_run(cmd(run, 4)))
    assert resumed["resumed_from"] == 2
    a, b = _losses(ref), _losses(run)
    assert b[3] == pytest.approx(a[3], rel=1e-6), (a, b)


def test_trainer_runs_the_expert_bias_update_after_every_step(monkeypatch):
    """A MoE with auxiliary-loss-free balancing: after each optimizer step the trainer moves every
    block's bias by bias_update_speed toward even load (down for an expert loaded above the mean,
    up below it), from the loads counted in that step. One process, 3 steps of moe-tiny (~2 s)."""
    import torch

    from dtorch.models import build_model
    from dtorch.models.moe import MoE
    from dtorch.train import Trainer

    speed, calls = 0.01, []
    original = MoE.update_bias

    def recording(self):
        load, before = self.expert_load.clone().double(), self.expert_bias.clone()
        original(self)
        calls.append((load, self.expert_bias - before))

    monkeypatch.setattr(MoE, "update_bias", recording)
    trainer = Trainer(model=lambda: build_model(f"moe-tiny:bias_update_speed={speed}"), global_batch=4,
                      seq_len=16, plan=Plan(), console=False)
    trainer.fit(steps=3)
    blocks = len(build_model("moe-tiny").moe_modules())
    assert len(calls) == 3 * blocks
    for load, delta in calls:
        assert load.sum() > 0  # the step's routing was counted
        assert torch.allclose(delta, speed * torch.sign(load.mean() - load).float())
    biases = [m.expert_bias for m in trainer.parallel.model_parts[0].moe_modules()]
    assert all(b.abs().sum() > 0 for b in biases)
