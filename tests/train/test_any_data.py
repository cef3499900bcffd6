"""The Trainer with data that does not fit the model: one line naming the module and the op,
raised while planning, before any step (docs/models.md). In-process; a second."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
import _any_models as Z  # noqa: E402

from dtorch.errors import ConfigError  # noqa: E402
from dtorch.train.trainer import Trainer  # noqa: E402


def test_data_the_model_cannot_take_is_one_line_before_training(tmp_path):
    wrong = [(x[:2], y) for x, y in Z.images(8)]  # 2 channels; the CNN's stem takes 3
    trainer = Trainer(model=Z.cnn, data=wrong, global_batch=4, checkpoint_dir=None, log_dir=tmp_path,
                      console=False, straggler_every=0)
    with pytest.raises(ConfigError) as err:
        trainer.fit(1)
    text = str(err.value)
    assert "\n" not in text and "'0' (Conv2d)" in text and "aten.convolution" in text
    assert trainer.step == 0
