"""A small convolutional classifier for examples/vision: two conv blocks and a linear head."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pipeline.params import ConfigError, read_params

if TYPE_CHECKING:
    from pipeline.config import Config

__all__ = ["CLASSES", "IMAGE_SIZE", "MODEL_SPEC", "SmallCNN", "build_model"]

# The model's output layout; the data factory labels its images with these names.
CLASSES = ["horizontal", "vertical", "square"]
IMAGE_SIZE = 16
MODEL_SPEC = {"width": (int, 16), "dropout": (float, 0.0)}


class SmallCNN(nn.Module):
    """``(batch, 3, S, S)`` images to ``(batch, classes)`` logits."""

    def __init__(self, *, image_size: int, num_classes: int, width: int, dropout: float) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * width * (image_size // 4) ** 2, num_classes)
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def build_model(config: Config) -> SmallCNN:
    """``model.factory``: input size from ``data.params.image_size``, one output per class."""
    params = read_params(config.model.params, "model.params", MODEL_SPEC)
    if params["width"] < 1:
        raise ConfigError(f"model.params.width must be >= 1 (got {params['width']})")
    if not 0 <= params["dropout"] < 1:
        raise ConfigError(f"model.params.dropout must be in [0, 1) (got {params['dropout']})")
    image_size = config.data.params.get("image_size", IMAGE_SIZE)
    if type(image_size) is not int:  # the data factory validates the rest of data.params
        raise ConfigError(
            f"data.params.image_size must be int, got {type(image_size).__name__} {image_size!r}"
        )
    if image_size < 8 or image_size % 4:
        raise ConfigError(f"data.params.image_size must be a multiple of 4, at least 8 (got {image_size})")
    return SmallCNN(image_size=image_size, num_classes=len(CLASSES), **params)
