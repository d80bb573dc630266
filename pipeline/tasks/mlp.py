"""The default task's model: a small MLP with Dropout (torch's CPU generator).

Model code only, importing nothing of the pipeline but :mod:`pipeline.params`, so the stage
ships it (with that helper) and a published repository loads without this project.
"""

from __future__ import annotations

from typing import Any

import torch

from ..params import ConfigError, read_params

__all__ = ["MLP", "MODEL_SPEC", "NUM_FEATURES", "build_model"]

MODEL_SPEC = {"hidden": (int, 16), "dropout": (float, 0.1)}
# The default of data.params.num_features, the model's input width.
NUM_FEATURES = 3


class MLP(torch.nn.Module):
    def __init__(self, in_features: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(in_features, hidden),
            torch.nn.Tanh(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(hidden, hidden),
            torch.nn.Tanh(),
            torch.nn.Dropout(dropout),
            torch.nn.Linear(hidden, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_model(config: Any) -> MLP:
    """An MLP whose input width is ``data.params.num_features``."""
    params = read_params(config.model.params, "model.params", MODEL_SPEC)
    if params["hidden"] < 1:
        raise ConfigError(f"model.params.hidden must be >= 1 (got {params['hidden']})")
    if not 0 <= params["dropout"] < 1:
        raise ConfigError(f"model.params.dropout must be in [0, 1) (got {params['dropout']})")
    features = config.data.params.get("num_features", NUM_FEATURES)
    if type(features) is not int:  # the data factory validates the rest of data.params
        raise ConfigError(f"data.params.num_features must be int, got {type(features).__name__} {features!r}")
    if features < 1:
        raise ConfigError(f"data.params.num_features must be >= 1 (got {features})")
    return MLP(features, params["hidden"], params["dropout"])
