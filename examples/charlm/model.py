"""A small decoder-only transformer over bytes, with the output projection tied to the embedding.

The tie (``head.weight is embed.weight``) is the case naive checkpointing gets wrong: the
state dict lists the tensor twice, a file written from it stores it twice, and a loader
that copies both names can silently untie them. The pipeline stores it once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

# The one helper of the pipeline that model code needs; the stage publishes it with this file.
from pipeline.params import ConfigError, read_params

if TYPE_CHECKING:
    from pipeline.config import Config

__all__ = ["MODEL_SPEC", "VOCAB_SIZE", "BLOCK_SIZE", "CharTransformer", "Block", "build_model"]

VOCAB_SIZE = 256  # every byte value
BLOCK_SIZE = 128  # the default context length, data.params.block_size (read by the data factory too)

MODEL_SPEC = {
    "d_model": (int, 128),
    "n_layer": (int, 4),
    "n_head": (int, 4),
    "dropout": (float, 0.1),
}


class Block(nn.Module):
    """Pre-norm causal self-attention and a 4x GELU MLP, each with a residual connection."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (
            t.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v)
        )
        # No dropout inside attention: it would force the slow math kernel on CPU.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self._attend(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class CharTransformer(nn.Module):
    """Byte ids ``(batch, length)`` to next-byte logits ``(batch, length, vocab)``."""

    def __init__(
        self, *, vocab_size: int, block_size: int, d_model: int, n_layer: int, n_head: int, dropout: float
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(_init_weights)
        # Tie after init: one Parameter, two names in state_dict().
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        if length > self.block_size:
            raise ValueError(f"sequence of {length} exceeds the model's block size {self.block_size}")
        positions = torch.arange(length, device=ids.device)
        x = self.drop(self.embed(ids) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _init_weights(module: nn.Module) -> None:
    # GPT-2's small-normal init; draws from torch's global generator, seeded before the factory runs.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_model(config: Config) -> CharTransformer:
    """``model.factory``: the context length is ``data.params.block_size``, the vocabulary all 256 bytes."""
    params = read_params(config.model.params, "model.params", MODEL_SPEC)
    block_size = config.data.params.get("block_size", BLOCK_SIZE)
    if type(block_size) is not int:  # the data factory validates the rest of data.params
        raise ConfigError(
            f"data.params.block_size must be int, got {type(block_size).__name__} {block_size!r}"
        )
    if block_size < 1:
        raise ConfigError(f"data.params.block_size must be >= 1 (got {block_size})")
    for key in ("d_model", "n_layer", "n_head"):
        if params[key] < 1:
            raise ConfigError(f"model.params.{key} must be >= 1 (got {params[key]})")
    if params["d_model"] % params["n_head"]:
        raise ConfigError(
            f"model.params.d_model ({params['d_model']}) must be a multiple of "
            f"model.params.n_head ({params['n_head']})"
        )
    if not 0 <= params["dropout"] < 1:
        raise ConfigError(f"model.params.dropout must be in [0, 1) (got {params['dropout']})")
    return CharTransformer(vocab_size=VOCAB_SIZE, block_size=block_size, **params)
