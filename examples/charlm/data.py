"""Byte-level text data for the character LM: no tokenizer, ids are the UTF-8 bytes (0-255).

- ``prepare`` (script 01) splits the text into ``train.safetensors`` and
  ``heldout.safetensors``, each one uint8 tensor ``ids``;
- a training example ``i`` is the window starting at ``i * block_size + offset``, where
  the offset in ``[0, block_size)`` is drawn per window from the task's *own* NumPy
  generator. That generator is state the pipeline cannot see, so :class:`CharData`
  exposes it through ``state_dict``/``load_state_dict`` and the checkpoint carries it;
- ``num_train`` is not a multiple of the batch size, so each epoch ends with a short
  batch and the next one starts on a fresh permutation.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from pipeline.checkpoint import write_safetensors
from pipeline.config import Config
from pipeline.errors import ConfigError, DataError
from pipeline.params import read_params

from .model import BLOCK_SIZE, VOCAB_SIZE

__all__ = ["VOCAB_SIZE", "DEFAULT_TEXT", "DATA_SPEC", "data_params", "prepare", "build_data", "CharData"]

DEFAULT_TEXT = Path(__file__).resolve().parent / "shakespeare.txt"
# Fixed second word of the offset generator's seed, so it never shares a stream with the
# run's own Generator(PCG64(training.seed)).
_OFFSET_STREAM = 0x0C4A
_EVAL_BATCH = 64

DATA_SPEC = {
    "text": (str, ""),
    "max_chars": (int, 0),
    "heldout_fraction": (float, 0.1),
    "block_size": (int, BLOCK_SIZE),
    "random_offset": (bool, True),
    "sample_prompt": (str, "HAMLET:\n"),
    "sample_chars": (int, 400),
    "sample_temperature": (float, 0.8),
    "sample_seed": (int, 0),
}


def data_params(config: Config) -> dict[str, Any]:
    """``data.params`` validated (the model factory reads ``block_size`` too)."""
    params = read_params(config.data.params, "data.params", DATA_SPEC)
    if params["block_size"] < 1:
        raise ConfigError(f"data.params.block_size must be >= 1 (got {params['block_size']})")
    if params["max_chars"] < 0:
        raise ConfigError(
            f"data.params.max_chars must be >= 0, 0 meaning the whole text (got {params['max_chars']})"
        )
    if not 0 < params["heldout_fraction"] < 1:
        raise ConfigError(
            f"data.params.heldout_fraction must be in (0, 1) (got {params['heldout_fraction']})"
        )
    if params["sample_chars"] < 0:
        raise ConfigError(f"data.params.sample_chars must be >= 0 (got {params['sample_chars']})")
    if params["sample_temperature"] <= 0:
        raise ConfigError(f"data.params.sample_temperature must be > 0 (got {params['sample_temperature']})")
    return params


def prepare(config: Config, out_dir: Path) -> None:
    """``data.prepare``: the text's bytes, the last ``heldout_fraction`` held out."""
    params = data_params(config)
    source = Path(params["text"]) if params["text"] else DEFAULT_TEXT
    if not source.is_file():
        raise ConfigError(f"data.params.text: {source} is not a file")
    raw = source.read_bytes()
    if params["max_chars"]:
        raw = raw[: params["max_chars"]]
    split = int(len(raw) * (1 - params["heldout_fraction"]))
    ids = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    write_safetensors(out_dir / "train.safetensors", {"ids": ids[:split].clone()})
    write_safetensors(out_dir / "heldout.safetensors", {"ids": ids[split:].clone()})


class CharData:
    """Training windows with a random offset, held-out bits per character, and a text sample."""

    def __init__(self, train: torch.Tensor, heldout: torch.Tensor, params: dict[str, Any], seed: int) -> None:
        block = params["block_size"]
        # Room for the largest offset plus the one-byte shift of the targets.
        self.num_train = len(train) // block - 1
        if self.num_train < 1:
            raise DataError(
                f"the training text ({len(train)} bytes) is too short for block_size {block}: "
                "it needs at least two blocks"
            )
        if len(heldout) < block + 1:
            raise DataError(
                f"the held-out text ({len(heldout)} bytes) is shorter than block_size + 1 = {block + 1}"
            )
        self.train = train.to(torch.int64)
        self.heldout = heldout.to(torch.int64)
        self.params = params
        self.block_size = block
        self.rng = np.random.Generator(np.random.PCG64([seed, _OFFSET_STREAM]))

    def logits(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Next-byte logits ``(batch, length, vocab)``; a task for another model class overrides this."""
        return model(ids)

    def get_batch(self, indices: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.block_size
        starts = np.asarray(indices, dtype=np.int64) * block
        if self.params["random_offset"]:
            starts = starts + self.rng.integers(0, block, size=len(starts))
        rows = torch.stack([self.train[s : s + block + 1] for s in starts.tolist()])
        return rows[:, :-1].to(device), rows[:, 1:].to(device)

    def loss(self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        logits = self.logits(model, inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        """Mean next-byte cross-entropy over every non-overlapping held-out window."""
        block = self.block_size
        count = (len(self.heldout) - 1) // block
        rows = self.heldout[: count * block + 1]
        inputs = rows[:-1].view(count, block)
        targets = rows[1:].view(count, block)
        total = 0.0
        was_training = model.training
        model.eval()
        try:
            for first in range(0, count, _EVAL_BATCH):
                logits = self.logits(model, inputs[first : first + _EVAL_BATCH].to(device))
                chunk = targets[first : first + _EVAL_BATCH].to(device)
                total += F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).double(), chunk.reshape(-1), reduction="sum"
                ).item()
        finally:
            model.train(was_training)
        loss = total / (count * block)
        return {"loss": loss, "bits_per_char": loss / math.log(2)}

    @torch.no_grad()
    def sample(self, model: torch.nn.Module, device: torch.device) -> str:
        """Text continued from ``sample_prompt``; the same weights always give the same text.

        Draws from a local generator only, so the run's RNG states are untouched.
        """
        params = self.params
        generator = torch.Generator(device="cpu").manual_seed(params["sample_seed"])
        ids = list(params["sample_prompt"].encode("utf-8")) or [ord("\n")]
        was_training = model.training
        model.eval()
        try:
            for _ in range(params["sample_chars"]):
                context = torch.tensor([ids[-self.block_size :]], dtype=torch.int64, device=device)
                logits = self.logits(model, context)[0, -1].double().cpu()
                probs = torch.softmax(logits / params["sample_temperature"], dim=-1)
                ids.append(int(torch.multinomial(probs, 1, generator=generator)))
        finally:
            model.train(was_training)
        return bytes(ids).decode("utf-8", errors="replace")

    def state_dict(self) -> dict[str, Any]:
        # The offset generator's full state: plain ints and strings, stored as JSON.
        return {"offset_rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["offset_rng"]
        if saved.get("bit_generator") != "PCG64":
            raise DataError(f"checkpoint's offset generator is {saved.get('bit_generator')}, expected PCG64")
        self.rng.bit_generator.state = saved


def build_data(config: Config, data_dir: Path, task: type[CharData] = CharData) -> CharData:
    """``data.factory``: the prepared ids; the offset generator is seeded from ``training.seed``.
    ``task`` is the class to build (examples/hf_llama passes its own)."""
    params = data_params(config)
    train = load_file(data_dir / "train.safetensors")["ids"]
    heldout = load_file(data_dir / "heldout.safetensors")["ids"]
    return task(train, heldout, params, config.training.seed)
