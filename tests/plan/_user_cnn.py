"""A user's image classifier for `dtorch plan --model _user_cnn:cnn`: no attention, token-free input."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10, c: int = 8, n_layer: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.layers = nn.ModuleList(nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.ReLU()) for _ in range(n_layer))
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.fc(x.mean((2, 3)))


def cnn() -> nn.Module:
    return SmallCNN()


def example_input() -> tuple[torch.Tensor, torch.Tensor]:
    """One batch (images, integer labels): what the profiler measures the model on."""
    return torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
