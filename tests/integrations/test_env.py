"""Allocation detection: each scheduler's variables -> nodes, node rank, rendezvous, ranks."""

import pytest

from dtorch.integrations import env as E


def test_hostlist_expansion_keeps_padding_and_products():
    assert E.expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert E.expand_hostlist("n[1-2]") == ["n1", "n2"]
    assert E.expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert E.tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_slurm_batch_step_gives_launch_defaults():
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_NNODES": "4",
           "SLURM_NODEID": "2", "SLURM_GPUS_ON_NODE": "8", "PATH": "/nonexistent"}
    a = E.detect(env)
    assert (a.scheduler, a.nnodes, a.node_rank, a.nproc_per_node) == ("slurm", 4, 2, 8)
    assert a.nodes[0] == "gpu01" and a.master_addr == "gpu01" and a.rank is None
    d = E.launch_defaults(env)
    assert d["nnodes"] == "4" and d["nproc_per_node"] == "8" and d["rdzv_id"] == "slurm-4242"
    assert d["rdzv_endpoint"] == f"gpu01:{20000 + 4242 % 10000}"


def test_srun_task_exports_rank_variables():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
           "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "MASTER_ADDR": "10.0.0.1", "PATH": "/nonexistent"}
    assert E.launch_defaults(env) == {}  # srun started every rank: nothing to launch per node
    a = E.export_rank_env(env)
    assert a is not None
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "1", "2")
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == str(20007)
    assert E.export_rank_env(env) is None  # RANK already set: left alone


def test_kubeflow_volcano_skypilot_torchrun():
    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0.job",
           "PET_MASTER_PORT": "29400"}
    a = E.detect(pet)
    assert (a.scheduler, a.nnodes, a.node_rank, a.rdzv_endpoint, a.nproc_per_node) == \
        ("kubeflow", 2, 1, "job-node-0-0.job:29400", 1)
    vc = {"PET_NNODES": "4", "PET_MASTER_ADDR": "j-worker-0.j", "VC_TASK_INDEX": "3"}
    assert (E.detect(vc).scheduler, E.detect(vc).node_rank) == ("volcano", 3)
    sky = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NODE_IPS": "10.1.0.5\n10.1.0.6\n", "SKYPILOT_NUM_NODES": "2",
           "SKYPILOT_NUM_GPUS_PER_NODE": "8"}
    s = E.detect(sky)
    assert (s.scheduler, s.nnodes, s.node_rank, s.master_addr, s.nproc_per_node) == ("skypilot", 2, 1, "10.1.0.5", 8)
    tr = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "WORLD_SIZE": "2", "RANK": "1"}
    assert E.detect(tr).scheduler == "torchrun" and E.launch_defaults(tr) == {}
    assert E.detect({}) is None and E.launch_defaults({}) == {}


@pytest.mark.parametrize("flag_given", [False, True])
def test_dtorch_run_takes_unset_flags_from_the_allocation(monkeypatch, flag_given):
    """`dtorch run` inside Kubeflow's environment: nnodes and the rendezvous come from PET_*,
    an explicit flag wins."""
    from dtorch.cli import build_parser
    from dtorch.integrations.env import launch_defaults

    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("PET_MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("PET_MASTER_PORT", "29411")
    argv = ["run", *(["--nnodes", "1"] if flag_given else []), "x.py"]
    args = build_parser(argv).parse_args(argv)
    alloc = launch_defaults()
    nnodes = args.nnodes if args.nnodes is not None else alloc.get("nnodes", "1")
    assert nnodes == ("1" if flag_given else "2")
    assert alloc["rdzv_endpoint"] == "127.0.0.1:29411"
