"""``model.factory``: a tiny ``LlamaForCausalLM`` built from a config (nothing downloaded).

Input and output embeddings are tied (``tie_word_embeddings``), so transformers keeps one
tensor, ``model.embed_tokens.weight``; the stage publishes it under that name.
``hub_files`` hands the tokenizer's files to the stage (see the README's "Your own model").
"""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.config import Config
from pipeline.errors import ConfigError
from pipeline.params import read_params

from .tokenizer import VOCAB_SIZE, tokenizer_files
from examples.charlm.data import data_params

__all__ = ["MODEL_SPEC", "build_model", "hub_files"]

MODEL_SPEC = {
    "hidden_size": (int, 64),
    "intermediate_size": (int, 128),
    "num_hidden_layers": (int, 2),
    "num_attention_heads": (int, 4),
}


def build_model(config: Config) -> LlamaForCausalLM:
    """The context length is ``data.params.block_size``; the vocabulary the tokenizer's 257 ids."""
    params = read_params(config.model.params, "model.params", MODEL_SPEC)
    for key, value in params.items():
        if value < 1:
            raise ConfigError(f"model.params.{key} must be >= 1 (got {value})")
    if params["hidden_size"] % params["num_attention_heads"]:
        raise ConfigError("model.params.hidden_size must be a multiple of model.params.num_attention_heads")
    end = VOCAB_SIZE - 1
    llama = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=data_params(config)["block_size"],
        num_key_value_heads=params["num_attention_heads"],
        tie_word_embeddings=True,
        bos_token_id=end,
        eos_token_id=end,
        pad_token_id=end,
        **params,
    )
    return LlamaForCausalLM(llama)


def hub_files(config: Config) -> dict[str, bytes]:
    """Files published beside the weights: the tokenizer, so AutoTokenizer.from_pretrained(repo) works."""
    return tokenizer_files()
