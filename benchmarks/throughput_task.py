"""The throughput benchmark's task: a small byte-level transformer LM and its windows of random
bytes, plugged into script 02 by import path as a user's own model and data are
(``data.factory: throughput_task:build_data``, ``model.factory: throughput_task:build_model``).

The plain loop and the Trainer of ``throughput.py`` build the very same model
(:class:`TinyLM`) and dataset (:class:`Windows`). The model's ``forward(input_ids, labels)``
returns ``{"loss": ...}``, which is what transformers' ``Trainer`` reads, so all three call the
same forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from pipeline.params import read_params

VOCAB = 256
TOKENS_FILE = "tokens.npy"
MODEL_SPEC = {"width": (int, 256), "layers": (int, 4), "heads": (int, 4), "context": (int, 64)}
DATA_SPEC = {"windows": (int, 4096), "context": (int, 64)}


class Block(nn.Module):
    """Pre-norm causal self-attention and a 4x GELU MLP, each with a residual connection."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Byte ids ``(batch, length)`` to next-byte logits; with ``labels``, ``{"loss": mean CE}``."""

    def __init__(self, *, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if labels is None:
            return logits
        return {"loss": F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))}


class Windows(torch.utils.data.Dataset):
    """Window ``i`` of the token file: ``input_ids`` and the next bytes as ``labels``."""

    def __init__(self, tokens: np.ndarray, context: int) -> None:
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.context = context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.context
        window = self.tokens[start : start + self.context + 1]
        return {"input_ids": window[:-1], "labels": window[1:]}


def model_params(config: Any) -> dict[str, Any]:
    return read_params(config.model.params, "model.params", MODEL_SPEC)


def data_params(config: Any) -> dict[str, Any]:
    return read_params(config.data.params, "data.params", DATA_SPEC)


def make_tokens(windows: int, context: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=windows * context + 1, dtype=np.uint8)


def prepare(config: Any, out_dir: Path) -> None:
    params = data_params(config)
    np.save(Path(out_dir) / TOKENS_FILE, make_tokens(params["windows"], params["context"], config.data.seed))


class Task:
    """Script 02's view of the task: the windows as a map-style ``train_dataset``."""

    def __init__(self, tokens: np.ndarray, context: int) -> None:
        self.train_dataset = Windows(tokens, context)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch)["loss"]

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        return {}


class BatchTask:
    """The same windows in the batch form: ``get_batch(indices)`` stacks them in the training
    process, with no DataLoader and no per-sample seeding (docs/data.md)."""

    loss = Task.loss
    evaluate = Task.evaluate

    def __init__(self, tokens: np.ndarray, context: int) -> None:
        self.windows = Windows(tokens, context)
        self.num_train = len(self.windows)

    def get_batch(self, indices: list[int], device: torch.device) -> dict[str, torch.Tensor]:
        windows = [self.windows[i] for i in indices]
        return {key: torch.stack([w[key] for w in windows]).to(device) for key in ("input_ids", "labels")}


def _tokens(data_dir: Path) -> np.ndarray:
    return np.load(Path(data_dir) / TOKENS_FILE, allow_pickle=False)


def build_data(config: Any, data_dir: Path) -> Task:
    return Task(_tokens(data_dir), data_params(config)["context"])


def build_batches(config: Any, data_dir: Path) -> BatchTask:
    return BatchTask(_tokens(data_dir), data_params(config)["context"])


def build_model(config: Any) -> TinyLM:
    return TinyLM(**model_params(config))
