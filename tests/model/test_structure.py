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


def test_a_part_without_its_blocks_is_an_error_not_a_silent_watch():
    structure = find_structure(_HFStyleLM())
    stage = _HFStyleLM()
    del stage.transformer.h  # a part that lost the container the structure names
    with pytest.raises(ConfigError, match="no blocks under 'transformer.h'"):
        blocks_of([stage], structure)
    bad = _HFStyleLM()
    bad._dtorch_blocks = "nowhere"
    with pytest.raises(ConfigError, match="nowhere"):
        find_blocks(bad)


class _Res(nn.Module):
    def __init__(self, c: int = 4):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv(x).relu()


def test_blocks_are_the_longest_same_class_run_at_any_depth():
    # a CNN as one nn.Sequential: the residual run, with the stem before and the head after it
    cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), _Res(), _Res(), _Res(), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(4, 10))
    s = find_structure(cnn)
    assert (s.block_path, s.block_names, s.before, s.after) == ("", ("2", "3", "4"), ("0",), ("7",))
    assert len(blocks_of([cnn], s)) == 3
    # stages of different widths (same class, other shapes): blocks, not uniform
    stages = nn.Module()
    stages.body = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    s = find_structure(stages)
    assert (s.block_path, s.num_blocks, s.uniform) == ("body", 3, False)
    # a ViT-style encoder.layers ModuleList deep inside the model
    vit = nn.Module()
    vit.encoder = nn.Module()
    vit.encoder.layers = nn.ModuleList([_Block() for _ in range(2)])
    assert find_structure(vit).block_path == "encoder.layers"


def test_a_model_without_repeated_blocks_is_one_unit():
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    s = find_structure(mlp)
    assert (s.block_path, s.num_blocks, s.has_blocks) == ("", 0, False)
    assert blocks_of([mlp], s) == [mlp]  # the monitor times the whole model as its one unit


def test_tied_parameters_are_named():
    m = _HFStyleLM(vocab=16)
    m.lm_head.weight = m.wte.weight
    assert find_structure(m).tied == (("wte.weight", "lm_head.weight"),)


def test_a_step_may_leave_parameters_unused_only_where_a_meta_forward_says_so() -> None:
    import torch
    from torch import nn

    from benchmarks import zoo
    from dtorch.model.structure import may_leave_parameters_unused

    with torch.device("meta"):
        gpt, branchy = zoo.NanoGPT(), zoo.BranchyNet()
        spare = nn.ModuleDict({"used": nn.Linear(4, 4), "spare": nn.Linear(4, 4)})
    spare.forward = lambda x: spare["used"](x)  # a registered layer the forward never calls
    assert not may_leave_parameters_unused(gpt, (torch.zeros(2, 8, dtype=torch.long),))
    assert may_leave_parameters_unused(branchy, (torch.zeros(2, 16),))  # picks a branch by value
    assert may_leave_parameters_unused(spare, (torch.zeros(2, 4),))
