"""A user's image classifier for `dtorch plan --model _user_cnn:cnn`: no attention, token-free input."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _pipeline_models import SmallCNN  # noqa: E402


def cnn() -> nn.Module:
    return SmallCNN()


def example_input() -> tuple[torch.Tensor, torch.Tensor]:
    """One batch (images, integer labels): what the profiler measures the model on."""
    return torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
