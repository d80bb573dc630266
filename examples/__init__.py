"""Example tasks that plug into the pipeline through config factories (see docs/own-model.md)."""
