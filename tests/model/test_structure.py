"""One model structure, found once (dtorch.model.structure) and used alike by the profiler, the
executor and the monitor: a model whose blocks live under another name than `layers` is watched
by the straggler watch and the live monitor exactly like the reference models (before, both looked
for `.layers` only and silently timed nothing). In-process, no process group; ~1 s."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtorch.errors import ConfigError
from dtorch.model import profile_module
from dtorch.model.structure import blocks_of, find_blocks, find_structure
from dtorch.models import build_model


class _Block(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class _Inner(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.h = nn.ModuleList([_Block() for _ in range(n)])


class _HFStyleLM(nn.Module):
    """Blocks under `transformer.h`, as in Hugging Face's GPT-2: not `layers`."""

    def __init__(self, n: int = 3, vocab: int = 32):
        super().__init__()
        self.wte = nn.Embedding(vocab, 16)
        self.transformer = _Inner(n)
        self.lm_head = nn.Linear(16, vocab, bias=False)

    def forward(self, ids):
        x = self.wte(ids)
        for b in self.transformer.h:
            x = b(x)
        return self.lm_head(x)


def test_structure_names_blocks_embedding_and_head_for_reference_and_other_models():
    s = find_structure(build_model("gpt:layers=3,hidden=32,heads=2,vocab=64,seq=16"))
    assert (s.block_path, s.num_blocks, s.uniform) == ("layers", 3, True)
    assert s.embeddings and s.head is not None
    s = find_structure(_HFStyleLM())
    assert (s.block_path, s.block_names, s.embeddings, s.head) == ("transformer.h", ("0", "1", "2"), ("wte",), "lm_head")
    # the profiler reads the same structure
    assert profile_module(_HFStyleLM, 8).block_path == "transformer.h"


def test_straggler_watch_times_every_block_whatever_its_name():
    from dtorch.monitor.straggler import StragglerWatch

    model = _HFStyleLM(n=3)
    structure = find_structure(model)
    watch = StragglerWatch([model], world_size=2, every=5, structure=structure)
    model(torch.zeros(2, 4, dtype=torch.long))
    assert watch.calls == 3 and watch.seconds > 0  # before: 0 calls, a watch that watched nothing
    watch.close()
    # DDP-wrapped parts (`.module`) and a pipeline stage holding fewer blocks resolve the same way
    stage = _HFStyleLM(n=3)
    del stage.transformer.h[1:]
    assert len(blocks_of([stage], structure)) == 1


def test_a_part_without_blocks_is_an_error_not_a_silent_watch():
    from dtorch.monitor.straggler import StragglerWatch

    with pytest.raises(ConfigError, match="_dtorch_blocks"):
        StragglerWatch([nn.Sequential(nn.Linear(2, 2))], world_size=2)
    with pytest.raises(ConfigError, match="_dtorch_blocks"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))
    bad = _HFStyleLM()
    bad._dtorch_blocks = "nowhere"
    with pytest.raises(ConfigError, match="nowhere"):
        find_blocks(bad)
