"""A model whose persistent buffer is computed from a code constant, for the stale-buffer
tests: the test copies this file beside its config, trains, then edits ``SCALE`` (the
"code that builds it") and loads again. ``bn`` holds trained statistics (BatchNorm)."""

from __future__ import annotations

import torch

from pipeline.config import Config
from pipeline.tasks.regression import build_model as build_mlp

SCALE = 1.0


class ScaledMLP(torch.nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.mlp = build_mlp(config)
        features = self.mlp.net[0].in_features
        self.bn = torch.nn.BatchNorm1d(features)
        self.register_buffer("scale", torch.full((features,), SCALE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.bn(x) * self.scale)


def build_model(config: Config) -> ScaledMLP:
    return ScaledMLP(config)
