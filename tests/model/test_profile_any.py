"""The profiler measures any model on one real batch of its data (docs/models.md): a CNN on
images, a ViT fed dicts, an MLP without repeated blocks, a model that branches on its input; and a
model it cannot run is refused in one line naming the module and the op, from the API and from
`dtorch plan --model pkg.module:factory`. In-process, no process group; a few seconds."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
import _any_models as Z  # noqa: E402

from dtorch.errors import ConfigError  # noqa: E402
from dtorch.model import profile_module  # noqa: E402
from dtorch.train.data import batch_for  # noqa: E402


def _sample(data):
    return batch_for(data, [0, 1])


def test_a_cnn_is_measured_per_image_on_its_own_sample():
    p = profile_module(Z.cnn, 128, sample=_sample(Z.images()), loss=Z.loss_fn("cross_entropy"), name="cnn")
    # a sample is one "token": the 128 given is not a dimension of this model
    assert (p.input_kind, p.seq_len, p.num_layers, p.block_path) == ("other", 1, 3, "")
    # no CP (it shards token sequences); the pipeline cut passes the image activations between stages
    assert "not a token sequence" in p.context_reason and p.pipeline_reason == ""
    # a residual block: two 3x3 convolutions 8 -> 8 over 16 x 16 pixels, 2 FLOPs per MAC, x3 for training
    assert p.flops_per_token_block == 3 * 2 * (2 * 8 * 8 * 9 * 16 * 16)
    assert p.params_per_block == sum(q.numel() for q in Z.ResBlock(8).parameters())
    assert p.params_total == sum(q.numel() for q in Z.cnn().parameters())
    assert p.num_heads == 0


def test_a_vit_fed_dicts_has_its_heads_from_the_attention_calls():
    p = profile_module(Z.vit, 128, sample=_sample(Z.image_dicts()), loss=Z.loss_fn("cross_entropy"))
    assert (p.block_path, p.num_layers, p.num_heads, p.num_kv_heads, p.input_kind) == ("encoder.layers", 2, 4, 4,
                                                                                        "other")
    assert "a dict of pixel_values" in p.context_reason


def test_a_model_without_repeated_blocks_is_one_unit_and_says_what_cannot_apply():
    p = profile_module(Z.mlp, 128, sample=_sample(Z.regression()), loss=Z.loss_fn("mse"))
    assert (p.num_layers, p.params_per_block, p.params_head) == (1, p.params_total, 0)
    act = p.act_bytes_per_token_block
    assert act["none"] == act["full"] == act["selective"] > 0  # nothing to checkpoint
    assert "no repeated blocks" in p.pipeline_reason and "no repeated blocks" in p.tp_roles_reason


def test_a_forward_that_branches_on_values_is_measured_on_a_real_copy():
    data = Z.branch_data([1.0, -1.0] * 4)
    p = profile_module(Z.branchy, 128, sample=_sample(data), loss=Z.loss_fn("cross_entropy"))
    # one sample per branch: each block runs pos on one sample and neg on the other (16 x 16 each)
    assert p.flops_per_token_block == 3 * 2 * (2 * 16 * 16) / 2
    assert p.num_layers == 2 and p.block_path == "blocks"


def test_a_model_that_fails_on_its_sample_is_one_line_naming_module_and_op():
    wrong = [(x[:2], y) for x, y in Z.images(4)]  # 2 channels, the stem wants 3
    with pytest.raises(ConfigError) as err:
        profile_module(Z.cnn, 128, sample=_sample(wrong), name="cnn")
    text = str(err.value)
    assert "\n" not in text
    assert "'0' (Conv2d)" in text and "aten.convolution" in text and "docs/models.md" in text


def test_token_ids_are_invented_only_for_a_language_model():
    with pytest.raises(ConfigError) as err:
        profile_module(Z.cnn, 128, name="pkg.cnn:build")
    assert "first layer is Conv2d" in str(err.value) and "example_input()" in str(err.value)


def test_dtorch_plan_with_a_factory_uses_example_input_or_says_how_to_give_one(tmp_path, monkeypatch, capsys):
    from dtorch.cli import main

    body = textwrap.dedent("""
        import sys
        sys.path.insert(0, {parallel!r})
        import _any_models as Z
        from dtorch.train.data import batch_for

        def build():
            return Z.cnn()
    """).format(parallel=str(Path(__file__).parents[1] / "parallel"))
    (tmp_path / "user_cnn.py").write_text(body)
    (tmp_path / "user_cnn_ex.py").write_text(body + "\n\ndef example_input():\n    return batch_for(Z.images(4), [0, 1])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "--model", "user_cnn:build", "--cluster", "cpu:1x2", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "first layer is Conv2d" in err and "example_input()" in err
    assert main(["plan", "--model", "user_cnn_ex:build", "--cluster", "cpu:1x2", "--global-batch", "8"]) == 0


def test_a_factory_in_the_current_directory_gets_the_pythonpath_fix(tmp_path, monkeypatch, capsys):
    """The dtorch command, like Python's console scripts, does not import from the current directory;
    a factory module found there gets that said, with the fix, in one line (exit 2)."""
    from dtorch.cli import main

    (tmp_path / "here_models.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(4, 4)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert main(["plan", "--model", "here_models:build", "--cluster", "cpu:1x2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'here_models' is in the current directory" in err and "PYTHONPATH=." in err
    assert main(["plan", "--model", "elsewhere_models:build", "--cluster", "cpu:1x2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "current directory" not in err and "use a preset" in err
