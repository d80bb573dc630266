"""``data.factory``: examples/charlm's byte windows, read through a transformers model's ``.logits``."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.config import Config

from examples.charlm.data import CharData
from examples.charlm.data import build_data as build_char_data

__all__ = ["LlamaData", "build_data"]


class LlamaData(CharData):
    """The same windows, loss, held-out bits per byte and sample as charlm."""

    def logits(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids).logits


def build_data(config: Config, data_dir: Path) -> LlamaData:
    return build_char_data(config, data_dir, LlamaData)
