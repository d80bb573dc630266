"""Exact-resume training on atomic, hashed local checkpoints, published to the Hub once."""

__all__ = ["__version__"]

__version__ = "0.1.0"
