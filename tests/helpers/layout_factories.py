"""A model whose parameters are not contiguous, plugged in by import path as a user's would be
(tests/test_state_roundtrip.py): ``w1`` is a transposed view of its own storage, ``w2`` every
other column of a buffer twice its size. Saving and restoring must keep every value in place."""

from __future__ import annotations

import torch

from pipeline.config import Config


class StridedMLP(torch.nn.Module):
    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.empty(hidden, features, dtype=torch.float64).t())
        self.b1 = torch.nn.Parameter(torch.zeros(hidden, dtype=torch.float64))
        self.w2 = torch.nn.Parameter(torch.empty(1, 2 * hidden, dtype=torch.float64)[:, ::2].t())
        torch.nn.init.normal_(self.w1, std=0.5)
        torch.nn.init.normal_(self.w2, std=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w1 + self.b1) @ self.w2


def build_model(config: Config) -> StridedMLP:
    model = StridedMLP(
        int(config.data.params.get("num_features", 3)), int(config.model.params.get("hidden", 16))
    )
    assert not model.w1.is_contiguous() and not model.w2.is_contiguous()
    return model
