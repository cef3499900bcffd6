"""The agent's detectors and the one place that records and acts on what they find (no workers
started: the agent is built on a real one-node c10d rendezvous handler, in this process)."""

from __future__ import annotations

import json
import os
import uuid
from types import SimpleNamespace

import pytest

from dtorch.elastic import events, store


@pytest.fixture
def agent(tmp_path):
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from dtorch.elastic.agent import DTorchAgent, GatedRendezvous

    params = RendezvousParameters(backend="c10d", endpoint="127.0.0.1:0", run_id=f"agent-{uuid.uuid4().hex[:8]}",
                                  min_nodes=1, max_nodes=1, local_addr="127.0.0.1")
    handler = GatedRendezvous(store.rendezvous_handler(params))
    spec = WorkerSpec(role="dtorch", local_world_size=1, entrypoint="true", args=(), rdzv_handler=handler,
                      max_restarts=3, monitor_interval=0.1)
    dspec = SimpleNamespace(run_dir=str(tmp_path), heartbeat_timeout=0, startup_timeout=0, shutdown_timeout=1,
                            grow_wait=1)
    a = DTorchAgent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), dspec=dspec)
    yield a
    handler.shutdown()


def test_every_detection_is_recorded_once_and_acted_on_by_its_action(agent):
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    from dtorch.elastic.agent import Detection

    healthy = RunResult(state=WorkerState.HEALTHY)
    out = agent._act(Detection("straggler", "report", ranks=[1], fields={"step": 20}), healthy)
    assert out is healthy and agent.detections == 0  # recorded, nothing restarted
    out = agent._act(Detection("node_lost", "restart", line="dtorch: node b lost", nodes=["b"], fault_t=1.0), healthy)
    assert out.state == WorkerState.UNHEALTHY and agent.detections == 1 and agent.recovery_pending
    failed = RunResult(state=WorkerState.FAILED)
    assert agent._act(Detection("fatal", "stop", fields={"rank": 0, "message": "bad --plan"}), failed) is failed
    assert agent.fatal == "bad --plan" and agent._remaining_restarts == 0
    kinds = [(e["kind"], e["cause"]) for e in events.read(agent.events_path)]
    assert kinds == [("observed", "straggler"), ("detected", "node_lost"), ("stopped", "fatal")]
    # only the restart is a recovery to wait for; the report is not mistaken for one
    assert [e["kind"] for e in events.read(agent.events_path) if e.get("fault_t") == 1.0] == ["detected"]


def test_straggler_detector_reads_the_workers_reports_once_and_skips_a_torn_line(agent):
    from dtorch.elastic.agent import StragglerDetector

    d = StragglerDetector(agent, period=0)
    assert d.check() is None
    events.log("straggler", agent.events_path, step=20, ranks=[1], ratio=[1.0, 2.5], epoch=0)
    with open(agent.events_path, "a") as f:
        f.write(json.dumps({"kind": "straggler", "t": 1.0, "ranks": [0]})[:20])  # still being written
    found = d.check()
    assert found.cause == "straggler" and found.action == "report" and found.ranks == [1]
    assert found.fields["step"] == 20 and d.check() is None
    with open(agent.events_path, "a") as f:
        f.write(json.dumps({"kind": "straggler", "t": 1.0, "ranks": [0]})[20:] + "\n")
    assert d.check().ranks == [0]
    assert os.path.getsize(agent.events_path) == d._offset


def test_reports_left_when_the_job_ends_are_still_recorded(agent):
    events.log("straggler", agent.events_path, step=10, ranks=[0], ratio=[3.0, 1.0], epoch=0)
    agent.stragglers.check()  # looked once, nothing new since: the next look would be a second away
    events.log("straggler", agent.events_path, step=11, ranks=[1], ratio=[1.0, 3.0], epoch=0)
    agent.drain_reports()
    assert [e["ranks"] for e in events.read(agent.events_path) if e["kind"] == "observed"] == [[1]]


def test_node_loss_counts_the_others_keep_alives_not_this_agents_own(monkeypatch):
    """This agent is alive (it runs the check): its own stale keep-alive (a starved thread on a loaded
    host) is no lost node. Another node's is; and a round that went on without us restarts us."""
    from datetime import datetime, timedelta, timezone

    from dtorch.elastic import agent as agent_mod
    from dtorch.elastic.agent import NodeLossDetector

    now = datetime.now(timezone.utc)
    state = SimpleNamespace(round=3, complete=True, participants={"me": 0, "peer": 1}, last_heartbeats={})
    fake = SimpleNamespace(epoch=3, rendezvous_state=lambda: state,
                           get_worker_group=lambda: SimpleNamespace(spec=SimpleNamespace(rdzv_handler=None)))
    monkeypatch.setattr(agent_mod.tc, "this_node", lambda handler: "me")
    monkeypatch.setattr(agent_mod.tc, "keep_alive_expiry", lambda handler: timedelta(seconds=5))

    def lost(me_age: float, peer_age: float, **change) -> dict:
        state.last_heartbeats = {"me": now - timedelta(seconds=me_age), "peer": now - timedelta(seconds=peer_age)}
        vars(state).update(change)
        d = NodeLossDetector(fake)
        d.new_round(SimpleNamespace(participants=["me", "peer"]))
        return d.lost()

    assert lost(me_age=30, peer_age=1) == {}  # only our own keep-alive lapsed
    assert set(lost(me_age=1, peer_age=30)) == {"peer"}
    assert set(lost(me_age=30, peer_age=30)) == {"peer"}
    assert set(lost(me_age=1, peer_age=1, round=4)) == {"me"}  # the others moved on without us
