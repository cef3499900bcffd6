"""Rank-local initialisation: every rank fills only its shard, and the weights are bit-identical
to single-device initialisation under every plan."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _training  # noqa: E402
from _harness import run_group  # noqa: E402

from dtorch.models import build_model, init  # noqa: E402

SEED = 3


def test_counter_generator_matches_its_pure_python_definition() -> None:
    idx = torch.tensor([0, 1, 2, 977, 12_345_678_901, 2**40 + 7])
    got = init.standard_normal(123, idx)
    want = torch.tensor([init.standard_normal_reference(123, int(i)) for i in idx], dtype=torch.float32)
    assert torch.equal(got, want)
    many = init.standard_normal(5, torch.arange(200_000))
    assert abs(float(many.mean())) < 0.01 and abs(float(many.std()) - 1.0) < 0.01


def test_any_box_of_a_parameter_is_the_same_box_of_the_whole_parameter() -> None:
    shape, key = (37, 11, 5), 99
    whole = init.standard_normal(key, torch.arange(37 * 11 * 5)).view(shape)
    offset, box = (4, 3, 1), (20, 6, 3)
    rows = list(init.box_chunks(box, max_elements=25))  # several chunks, one row minimum each
    assert len(rows) > 1
    parts = [init.standard_normal(key, init.flat_indices(shape, offset, box, r)) for r in rows]
    assert torch.equal(torch.cat(parts), whole[4:24, 3:9, 1:4])


def test_meta_then_to_empty_gives_the_cpu_weights() -> None:
    cpu = build_model("llama-tiny")
    cpu.init_weights(SEED)
    with torch.device("meta"):
        meta = build_model("llama-tiny")
    meta.to_empty(device="cpu")
    meta.init_weights(SEED)
    for (n, a), (_, b) in zip(cpu.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), n


CASES_4 = {
    "fsdp": dict(dp_shard=4),
    "tp_sp": dict(tp=4, sp=True),
    "fsdp_x_tp_sp": dict(dp_shard=2, tp=2, sp=True),
    "hsdp": dict(dp_replicate=2, dp_shard=2),
    "fsdp_x_pp": dict(dp_shard=2, pp=2, schedule="1f1b", num_microbatches=2),
    "tp_x_pp": dict(tp=2, pp=2, schedule="1f1b", num_microbatches=2),
    "gpt_fsdp_x_tp_sp": dict(model="gpt-tiny", dp_shard=2, tp=2, sp=True),
}


def _worker(case: tuple[str, dict], rank: int) -> dict:
    from functools import partial

    from torch.distributed.tensor import DTensor, distribute_tensor

    from dtorch.parallel import parallelize
    from dtorch.parallel.materialize import clean_name
    from dtorch.plan.plan import Plan
    from dtorch.train.losses import next_token

    kwargs = dict(case[1])
    name = kwargs.pop("model", "llama-tiny")
    pm = parallelize(partial(_training.factory, name), Plan(**kwargs), loss_fn=next_token, seed=SEED,
                     seq_len=_training.SEQ)
    ref = _training.factory(name)
    ref.init_weights(SEED)
    full = dict(ref.named_parameters())
    mismatched, checked, sharded = [], 0, 0
    for part in pm.model_parts:
        for pname, p in part.named_parameters():
            src = full[clean_name(pname)].detach()
            if isinstance(p, DTensor):
                want = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None).to_local()
                got = p.to_local()
                sharded += got.numel() < src.numel()
            else:
                want, got = src, p.detach()
            checked += 1
            if not torch.equal(got, want):
                mismatched.append(clean_name(pname))
    return {"path": pm.startup["path"], "mismatched": mismatched, "checked": checked, "sharded": sharded}


@pytest.fixture(scope="module")
def world4() -> dict:
    return dict(zip(CASES_4, run_group(4, list(CASES_4.items()), _worker)))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_4))
def test_rank_local_init_equals_single_device_init(world4: dict, name: str) -> None:
    for r, res in enumerate(world4[name]):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        assert res["path"] == "rank-local"
        assert res["checked"] > 0 and res["sharded"] > 0
        assert res["mismatched"] == [], f"rank {r}"


def test_dry_run_reports_startup_memory_and_checkpoint_bytes_per_rank() -> None:
    from dtorch.parallel.dryrun import verify
    from dtorch.plan.plan import Plan

    with torch.device("meta"):
        n = sum(p.numel() for p in build_model("llama3-8b", max_seq_len=512).parameters())
    res = verify(Plan(dp_shard=4, tp=2), "llama3-8b", 512)
    st = res["startup_max"]
    # every rank holds and reads about 1/8 of the model (TP-replicated norms are a rounding error)
    assert st["checkpoint_read_bytes"] == pytest.approx(2 * n / 8, rel=0.01)
    assert 4 * n / 8 < st["host_bytes_rank_local_init"] < 4 * n / 8 + 64e6
    assert st["host_bytes_checkpoint_load"] > 4 * n / 8


def test_seed_checkpoint_starts_any_module_from_its_slices(tmp_path) -> None:
    from torch import nn

    from dtorch.checkpoint.hf_weights import HFWeights, write_seed_checkpoint
    from dtorch.parallel.materialize import Startup, materialize

    class Mine(nn.Module):  # no seeded init: not rank-local
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 4)
            self.register_buffer("scale", torch.full((4,), 0.5))

        def forward(self, x):
            return self.b(self.a(x)) * self.scale

    torch.manual_seed(0)
    real = Mine()
    write_seed_checkpoint(real, tmp_path, max_shard_bytes=200)  # several files and an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    with torch.device("meta"):
        meta = Mine()
    w = HFWeights(tmp_path)
    st = Startup(Mine, meta, 0, w)
    assert st.path == "weights"
    stats = materialize([meta], st, torch.device("cpu"))
    assert stats["bytes_read"] == 4 * sum(p.numel() for p in real.parameters()) + 4 * 4
    for (n, a), (_, b) in zip(real.state_dict().items(), meta.state_dict().items()):
        assert torch.equal(a, b), n
