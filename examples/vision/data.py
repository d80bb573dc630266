"""A small image set as users have it: PNG images in a parquet file, read with ``datasets``,
augmented per sample (random crop and flip) in DataLoader workers.

Script 01 draws the images: three classes of 16x16 RGB pictures (horizontal stripes,
vertical stripes, a filled square), colors and offsets from ``data.seed``, written with
``datasets`` to ``train.parquet`` and ``heldout.parquet`` (PNG bytes plus a class label).
Training reads ``train.parquet`` with ``datasets.load_dataset("parquet", ...)``; each
sample is padded and cropped back at a random offset and flipped left-right half the
time. The randomness comes from Python's ``random`` and torch's generator, which the
pipeline seeds for every sample from (seed, epoch, index): the same pictures with any
``data.num_workers`` and after a resume (docs/data.md).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from pipeline.config import Config
from pipeline.errors import ConfigError, DataError
from pipeline.factories import read_params

from .model import CLASSES, IMAGE_SIZE

__all__ = ["DATA_SPEC", "CLASSES", "data_params", "prepare", "build_data", "VisionData", "AugmentedImages"]

DATA_SPEC = {
    "num_train": (int, 96),
    "num_heldout": (int, 48),
    "image_size": (int, IMAGE_SIZE),
    "crop_padding": (int, 2),
}


def data_params(config: Config) -> dict[str, Any]:
    params = read_params(config.data.params, "data.params", DATA_SPEC)
    for key in ("num_train", "num_heldout"):
        if params[key] < 1:
            raise ConfigError(f"data.params.{key} must be >= 1 (got {params[key]})")
    if params["image_size"] < 8 or params["image_size"] % 4:
        raise ConfigError(
            f"data.params.image_size must be a multiple of 4, at least 8 (got {params['image_size']})"
        )
    if not 0 <= params["crop_padding"] < params["image_size"] // 2:
        raise ConfigError(
            f"data.params.crop_padding must be in [0, image_size/2) (got {params['crop_padding']})"
        )
    return params


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError(
            "examples/vision reads its images with Hugging Face datasets: pip install "
            "'exact-resume-pipeline[datasets]'"
        ) from None
    return datasets


def _picture(label: int, size: int, rng: np.random.Generator):
    from PIL import Image

    background, ink = rng.integers(0, 100, size=3), rng.integers(150, 256, size=3)
    pixels = np.empty((size, size, 3), dtype=np.uint8)
    pixels[:] = background
    offset = int(rng.integers(0, 4))
    if label == 0:
        pixels[offset::4, :] = ink
    elif label == 1:
        pixels[:, offset::4] = ink
    else:
        side = size // 2
        top, left = rng.integers(0, size - side, size=2)
        pixels[top : top + side, left : left + side] = ink
    return Image.fromarray(pixels, mode="RGB")


def prepare(config: Config, out_dir: Path) -> None:
    """``data.prepare``: draw the pictures and write them as parquet through ``datasets``."""
    datasets = _datasets()
    params = data_params(config)
    rng = np.random.Generator(np.random.PCG64(config.data.seed))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    for split in ("train", "heldout"):
        labels = [i % len(CLASSES) for i in range(params[f"num_{split}"])]
        images = [_picture(label, params["image_size"], rng) for label in labels]
        table = datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)
        table.to_parquet(str(out_dir / f"{split}.parquet"))


def _tensor(image: Any) -> torch.Tensor:
    """A PIL image as a float ``(3, H, W)`` tensor in [0, 1]."""
    return (
        torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1).float()
        / 255
    )


class AugmentedImages(torch.utils.data.Dataset):
    """``(image, label)`` with a random crop (pad, then crop back at a random offset) and a
    random left-right flip: torch's and Python's generators, seeded per sample by the pipeline."""

    def __init__(self, table: Any, padding: int) -> None:
        self.table, self.padding = table, padding

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        row = self.table[index]
        image = _tensor(row["image"])
        if self.padding:
            size = image.shape[-1]
            padded = F.pad(image, [self.padding] * 4, mode="reflect")
            top, left = torch.randint(0, 2 * self.padding + 1, (2,)).tolist()
            image = padded[:, top : top + size, left : left + size]
        if random.random() < 0.5:
            image = image.flip(-1)
        return image.contiguous(), row["label"]


class VisionData:
    """The training set for a DataLoader; held-out accuracy and loss for script 04."""

    def __init__(self, train: Any, heldout: Any, padding: int) -> None:
        self.train_dataset = AugmentedImages(train, padding)
        self.heldout_images = torch.stack([_tensor(image) for image in heldout["image"]])
        self.heldout_labels = torch.tensor(heldout["label"], dtype=torch.int64)

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        was_training = model.training
        model.eval()
        try:
            logits = model(self.heldout_images.to(device))
            labels = self.heldout_labels.to(device)
            loss = F.cross_entropy(logits, labels).item()
            accuracy = (logits.argmax(dim=1) == labels).double().mean().item()
        finally:
            model.train(was_training)
        return {"accuracy": accuracy, "loss": loss, "perplexity": math.exp(loss)}


def build_data(config: Config, data_dir: Path) -> VisionData:
    """``data.factory``: both splits read back with ``datasets``."""
    datasets = _datasets()
    splits = {
        name: datasets.load_dataset("parquet", data_files=str(data_dir / f"{name}.parquet"), split="train")
        for name in ("train", "heldout")
    }
    return VisionData(splits["train"], splits["heldout"], data_params(config)["crop_padding"])
