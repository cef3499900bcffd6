"""torchrun's static flags in `dtorch run`: `--node-rank`, `--master-addr`/`--master-port`,
`--log-dir`, `--redirects`, `--tee` (torch/distributed/run.py gives their meaning), mapped to
the elastic launch; what cannot be honoured is a one-line ConfigError."""

import argparse
import glob
import os
import socket
import subprocess
import sys

import pytest

from dtorch.cli import main
from dtorch.cli.run import add_parser, rendezvous
from dtorch.elastic.launch import LaunchSpec
from dtorch.errors import ConfigError

CLI = [sys.executable, "-m", "dtorch.cli", "run"]

# A worker that says which global rank it got, then proves the group works with one all_reduce.
WORKER = """
import torch, torch.distributed as dist
from dtorch.elastic import worker
worker.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"hello from rank {dist.get_rank()} of {dist.get_world_size()} sum {int(t.item())}", flush=True)
dist.destroy_process_group()
"""


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(), "run")
    return p.parse_args(["run", *argv, "train.py"])


def test_static_flags_choose_torchruns_static_rendezvous_at_master_addr_and_port():
    a = _args("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29511")
    assert rendezvous(a, 2) == ("static", "10.0.0.1:29511")
    # torchrun's defaults: 127.0.0.1 and 29500
    assert rendezvous(_args("--nnodes", "2", "--node-rank", "1"), 2) == ("static", "127.0.0.1:29500")
    # an explicit endpoint is node 0's address for the static rendezvous too
    assert rendezvous(_args("--node-rank", "1", "--rdzv-endpoint", "h:1"), 2) == ("static", "h:1")
    # one node with no port: the c10d rendezvous on a free port, as torchrun does
    assert rendezvous(_args("--node-rank", "0"), 1) == ("c10d", "127.0.0.1:0")
    # no static flag: DTorch's elastic default, endpoint left to the allocation or loopback
    assert rendezvous(_args(), 1) == ("c10d", None)
    assert rendezvous(_args("--standalone"), 1) == ("c10d", "127.0.0.1:0")


@pytest.mark.parametrize("argv,field", [
    (("--rdzv-backend", "c10d", "--node-rank", "1"), "node_rank"),  # torchrun warns and ignores it
    (("--rdzv-backend", "c10d", "--master-addr", "h"), "master_addr"),
    (("--rdzv-endpoint", "h:1", "--master-port", "29500"), "master_port"),  # two addresses for node 0
    (("--standalone", "--node-rank", "1"), "node_rank"),  # torchrun ignores the explicit value
    (("--standalone", "--rdzv-endpoint", "h:1"), "rdzv_endpoint"),
])
def test_static_flags_that_cannot_be_honoured_are_config_errors(argv, field):
    with pytest.raises(ConfigError) as e:
        rendezvous(_args(*argv), 2)
    assert e.value.field == field


@pytest.mark.parametrize("kw,field", [
    ({"min_nodes": 1, "max_nodes": 2}, "nnodes"),  # a static rendezvous has a fixed size
    ({"node_rank": 2}, "node_rank"),
    ({"max_restarts": 1}, "max_restarts"),  # one node's restart would wait for the others forever
    ({"redirects": "4"}, "redirects"),
    ({"tee": "0:x"}, "tee"),
    ({"rdzv_conf": {"rank": "1"}}, "rdzv_conf"),  # the node's rank has one source: --node-rank
])
def test_static_launch_spec_mistakes_raise_config_error(kw, field):
    base = {"rdzv_backend": "static", "rdzv_endpoint": "127.0.0.1:29500", "min_nodes": 2, "max_nodes": 2,
            "max_restarts": 0, "node_rank": 0}
    with pytest.raises(ConfigError) as e:
        LaunchSpec(**{**base, **kw})
    assert e.value.field == field


def test_node_rank_with_the_elastic_rendezvous_is_refused_in_one_line(capsys):
    assert main(["run", "--rdzv-backend", "c10d", "--node-rank", "1", "train.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "node_rank" in err[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_static_nodes_get_their_given_ranks_and_log_where_told(tmp_path):
    """Two agents as two nodes: node 1 starts first, yet its worker is global rank 1; node 0 tees
    stdout (file and console), node 1 redirects it (file only), both under --log-dir."""
    script = tmp_path / "hello.py"
    script.write_text(WORKER)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = {}
    for node, stream in ((1, ("--redirects", "1")), (0, ("--tee", "1"))):
        logs = tmp_path / f"logs{node}"
        procs[node] = (logs, subprocess.Popen(
            [*CLI, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr",
             "127.0.0.1", "--master-port", str(port), "--log-dir", str(logs), *stream,
             "--start-method", "spawn", "--run-dir", str(tmp_path / f"run{node}"), str(script)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = {}
    for node, (logs, p) in procs.items():
        try:
            out[node] = p.communicate(timeout=60)[0]
        finally:
            p.kill()
        assert p.returncode == 0, out[node]
        files = glob.glob(str(logs / "*" / "attempt_0" / "0" / "stdout.log"))
        assert len(files) == 1, f"no stdout log under {logs}: {out[node]}"
        with open(files[0]) as f:
            assert f"hello from rank {node} of 2 sum 2" in f.read()
    assert "hello from rank 0 of 2" in out[0]  # tee: on the console too
    assert "hello from rank" not in out[1]  # redirect: in the file only


def test_one_static_node_restarts_a_killed_worker_into_a_fresh_round(tmp_path, marker, dtorch_run):
    """On one node a static rendezvous can restart: each round publishes a new workers' store."""
    out = str(tmp_path / "out")
    p = dtorch_run(out, marker, "--node-rank", "0", "--master-port", str(_free_port()), "--chaos",
                   "kill:rank=1:step=3", steps=6, nproc=2, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "recovered from exit of rank(s) [1]" in p.stderr
    with open(os.path.join(out, "steps.jsonl")) as f:
        assert len(f.read().splitlines()) == 6
