"""A worker killed mid-step between durable checkpoints costs one step: the group restores the
in-memory snapshot of the step before, and every loss is bit-identical to an uninterrupted run.
Real `dtorch train` at world 2 (DDP; FSDP, TP and PP, where each rank snapshots its own shards or
stage), real SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dtorch.elastic import events

pytestmark = [pytest.mark.slow]

CLI = [sys.executable, "-m", "dtorch.cli", "train"]
ARGS = ["--nproc", "2", "--model", "gpt:layers=1,hidden=32,heads=2,vocab=256,seq=64", "--seq-len", "32",
        "--sample-tokens", "0", "--no-progress", "--steps", "30", "--checkpoint-every", "50", "--plan", "dp_replicate=2"]


def _train(tmp_path, name: str, *extra: str, args: list[str] = ARGS) -> list[dict]:
    ckpt, run = tmp_path / name / "ckpt", tmp_path / name / "run"
    p = subprocess.run([*CLI, *args, "--checkpoint-dir", str(ckpt), "--run-dir", str(run), *extra],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    with open(ckpt / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "loss" in r], events.read(str(run / events.EVENTS_FILE))


_BASE: list[dict] = []


def _base(tmp_path) -> list[dict]:
    """The uninterrupted run of ARGS (once per session: two tests compare with it)."""
    if not _BASE:
        _BASE.extend(_train(tmp_path, "base")[0])
    return _BASE


def test_kill_between_durable_checkpoints_redoes_one_step_bit_identically(tmp_path):
    base = _base(tmp_path)
    drill, evs = _train(tmp_path, "drill", "--chaos", "kill:rank=1:step=23:phase=forward_backward")
    (fault,) = [e for e in evs if e["kind"] == "fault"]
    (restore,) = [e for e in evs if e["kind"] == "phase" and e.get("name") == "snapshot_restore" and e["rank"] == 0]
    assert fault["step"] == 23 and restore["step"] == 22 and restore["durable_step"] == 0
    steps = [r["step"] for r in drill]
    assert steps == list(range(1, 31)), steps  # step 23 was interrupted before it ended: only it is redone
    assert {r["step"]: r["loss"] for r in drill} == {r["step"]: r["loss"] for r in base}


@pytest.mark.parametrize("plan", ["dp_shard=2", "tp=2", "pp=2"])
def test_sharded_plans_restore_their_own_shards_and_redo_one_step(tmp_path, plan):
    """FSDP and TP snapshot the local shard of every DTensor (parameters and optimizer state) and
    rebuild the same DTensors; PP snapshots each rank's stage. About 15-25 s per plan (two runs)."""
    args = [*ARGS[:ARGS.index("--steps")], "--steps", "10", "--checkpoint-every", "50", "--plan", plan]
    args[args.index("--model") + 1] = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=64"  # two blocks: two stages
    base, _ = _train(tmp_path, "base", args=args)
    drill, evs = _train(tmp_path, "drill", "--chaos", "kill:rank=1:step=6:phase=forward_backward", args=args)
    (fault,) = [e for e in evs if e["kind"] == "fault"]
    restores = [e for e in evs if e["kind"] == "phase" and e.get("name") == "snapshot_restore"]
    assert fault["step"] == 6 and sorted(e["rank"] for e in restores) == [0, 1]
    assert all(e["step"] == 5 and e["durable_step"] == 0 for e in restores), restores
    assert [r["step"] for r in drill] == list(range(1, 11))  # only the interrupted step 6 is redone
    assert {r["step"]: r["loss"] for r in drill} == {r["step"]: r["loss"] for r in base}


RUN = [sys.executable, "-m", "dtorch.cli", "run"]


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_lost_node_resumes_from_the_replica_on_its_peer_node_bit_identically(tmp_path, marker):
    """Two agents of one worker each as two "nodes" (world 2, one rank per node). At step 23 the
    chaos fault SIGKILLs rank 1's agent and rank 1 (its whole node, snapshots included). The
    survivor waits (--nnodes 2) for the node to be restarted; the restarted group restores the
    newest step of which both ranks' snapshots survive: rank 1's from the replica its peer node
    holds, sent to it over the replication group; no durable checkpoint exists. Every loss is
    bit-identical to an uninterrupted run. About 35-60 s on a loaded 2-core machine."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    job = [a for a in ARGS if a not in ("--nproc", "2")] + ["--checkpoint-dir", str(ckpt)]
    cmd = [*RUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", marker, "--run-dir", str(run), "--max-restarts", "3",
           "--chaos", "killnode:rank=1:step=23:phase=forward_backward", "-m", "dtorch.train.job", *job]
    # the killed agent cannot remove its snapshot directory: keep them all under tmp_path
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DTORCH_TEST_MARKER": marker,
           "DTORCH_SNAPSHOT_ROOT": str(tmp_path)}
    procs = []

    def start(name: str) -> subprocess.Popen:
        with open(tmp_path / f"{name}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        return procs[-1]

    t0 = time.time()
    try:
        agents = [start("a")]
        # A hosts the rendezvous store and, started first, gets node rank 0 (ranks go by pid); B starts
        # once the store listens: under load a fixed pause let B bind it first, and the chaos kill of B
        # then took the store with it (the survivor's next rendezvous: "connection to the C10d store")
        while not _listening(port):
            assert time.time() - t0 < 120 and agents[0].poll() is None, "node A's rendezvous store never listened"
            time.sleep(0.25)
        agents.append(start("b"))
        while all(p.poll() is None for p in agents):
            assert time.time() - t0 < 150, "no node was lost"
            time.sleep(0.1)
        (lost,) = [p for p in agents if p.poll() is not None]
        assert lost.returncode == -signal.SIGKILL and lost is agents[1], [p.poll() for p in agents]
        again = start("b2")
        for p in (agents[0], again):
            p.wait(timeout=150)
            assert p.returncode == 0, "".join(open(tmp_path / f"{n}.log").read()[-3000:] for n in ("a", "b2"))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    wall = time.time() - t0
    evs = events.read(str(run / events.EVENTS_FILE))
    (fault,) = [e for e in evs if e["kind"] == "fault"]
    restores = [e for e in evs if e["kind"] == "phase" and e.get("name") == "snapshot_restore"]
    assert fault["step"] == 23 and fault["fault_kind"] == "killnode" and len(restores) == 2, restores
    (step,) = {e["step"] for e in restores}
    # the lost node's replica is at most one take behind its own snapshot (of step 22)
    assert step in (21, 22) and all(e["durable_step"] == 0 for e in restores), restores
    assert sorted(r for e in restores for r in e["from_peer"]) == [1, 1]  # rank 1's state came from node 0
    with open(ckpt / "metrics.jsonl") as f:
        drill = [r for r in map(json.loads, f) if "loss" in r]
    assert not [r for r in drill if r.get("event") == "resume"]  # nothing read from disk
    base = {r["step"]: r["loss"] for r in _base(tmp_path)}
    assert [r["step"] for r in drill] == list(range(1, 23)) + list(range(step + 1, 31))
    assert all(r["loss"] == base[r["step"]] for r in drill)
    print(f"node lost at step 23: resumed from the snapshot of step {step} ({23 - step} steps redone, "
          f"rank 1's from its peer node); wall {wall:.1f} s")


def _zero_embedding(snap_root, rank: int, step: int) -> str:
    """Zero, in place, the token embedding of `rank`'s in-memory snapshot of `step` (what another
    process of the same user could do to the shared-memory files); returns the file zeroed."""
    import io
    import pickle

    (d,) = [p for p in snap_root.iterdir() if p.name.startswith("dtorch-snap-")]
    raw = (d / f"rank{rank}-slot{step % 2}.hdr").read_bytes()
    if raw.startswith(b"DTSNAP"):  # signed header: magic, 32-byte MAC, then the pickle
        raw = raw[raw.index(b"\n") + 1 + 32:]
    doc = pickle.Unpickler(io.BytesIO(raw)).load()
    assert doc["step"] == step, doc["step"]
    (ref,) = [v for k, v in doc["tree"]["model"]["0"].items() if "tok_embeddings" in k]
    path = d / ref["__shm__"]
    with open(path, "r+b") as f:
        f.write(bytes(path.stat().st_size))
    return str(path)


def test_a_snapshot_edited_in_shared_memory_is_skipped_and_named_at_a_real_kill(tmp_path):
    """Rank 1 is SIGKILLed mid-step 23; while the group restarts, another process zeroes the token
    embedding in rank 0's shared-memory snapshot of step 22. The snapshot fails its HMAC: it is
    named in a `snapshot_rejected` event and skipped, the group restores the other slot (step 21),
    redoes steps 22 and 23, and every loss is bit-identical to an uninterrupted run."""
    base = _base(tmp_path)
    ckpt, run, snaps = tmp_path / "edit" / "ckpt", tmp_path / "edit" / "run", tmp_path / "edit" / "shm"
    snaps.mkdir(parents=True, mode=0o700)
    log = open(tmp_path / "edit.log", "w")  # noqa: SIM115 - closed below
    p = subprocess.Popen([*CLI, *ARGS, "--checkpoint-dir", str(ckpt), "--run-dir", str(run),
                          "--chaos", "kill:rank=1:step=23:phase=forward_backward"],
                         env={**os.environ, "OMP_NUM_THREADS": "1", "DTORCH_SNAPSHOT_ROOT": str(snaps)},
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0, edited = time.time(), None
        while edited is None:
            assert p.poll() is None and time.time() - t0 < 240, open(tmp_path / "edit.log").read()[-3000:]
            if any(e["kind"] == "fault" for e in events.read(str(run / events.EVENTS_FILE))):
                edited = (_zero_embedding(snaps, 0, 22), time.time())
            time.sleep(0.02)
        assert p.wait(timeout=240) == 0, open(tmp_path / "edit.log").read()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        log.close()
    evs = events.read(str(run / events.EVENTS_FILE))
    (rejected,) = [e for e in evs if e["kind"] == "snapshot_rejected"]
    assert rejected["snapshot_rank"] == 0 and rejected["step"] == 22 and "HMAC" in rejected["why"], rejected
    restores = [e for e in evs if e["kind"] == "phase" and e.get("name") == "snapshot_restore"]
    assert restores and all(e["step"] == 21 and e["start"] > edited[1] for e in restores), (restores, edited)
    assert "snapshot of rank 0 at step 22 (own node) skipped" in open(tmp_path / "edit.log").read()
    with open(ckpt / "metrics.jsonl") as f:
        drill = [r for r in map(json.loads, f) if "loss" in r]
    assert [r["step"] for r in drill] == list(range(1, 23)) + list(range(22, 31))  # 22 and 23 redone
    assert all(r["loss"] == {b["step"]: b["loss"] for b in base}[r["step"]] for r in drill)
