"""A byte-level tokenizer built offline with ``tokenizers``: token id ``b`` is byte ``b``.

The ids are exactly the bytes examples/charlm prepares, so the same data trains the model,
and ``AutoTokenizer.from_pretrained(repo)`` encodes text into the ids the model was
trained on. One extra token, ``<|endoftext|>`` (id 256), ends generated text.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

__all__ = ["END_OF_TEXT", "VOCAB_SIZE", "build_tokenizer", "tokenizer_files"]

END_OF_TEXT = "<|endoftext|>"
VOCAB_SIZE = 257  # 256 bytes + <|endoftext|>


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte (ByteLevel pre-tokenizer's alphabet), by byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[byte] for byte in range(256)]


def build_tokenizer() -> Tokenizer:
    """Bytes in, one token per byte, no merges; decoding joins the bytes back."""
    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END_OF_TEXT])
    return tokenizer


def tokenizer_files() -> dict[str, bytes]:
    """The files ``save_pretrained`` writes for this tokenizer (tokenizer.json, tokenizer_config.json, ...)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        eos_token=END_OF_TEXT,
        bos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
    )
    with tempfile.TemporaryDirectory() as folder:
        fast.save_pretrained(folder)
        return {path.name: path.read_bytes() for path in sorted(Path(folder).iterdir()) if path.is_file()}
