"""A tiny transformers LlamaForCausalLM with a byte-level tokenizer, published for the Hub's own tools (see README.md)."""
