"""A character-level transformer language model on three Shakespeare tragedies (see README.md)."""
