"""Training under torchrun (DDP, FSDP2) with pickle-free distributed checkpoints.

==============  ==============================================================
``world``       this rank, the process group, agreement on errors and signals
``checkpoint``  the commit protocol across ranks; restore (and reshard) via DCP
``verify``      meta.json, hashes and shard coverage, before DCP reads a byte
``consolidate`` one ``modelo.safetensors`` from the model shards (script 05)
``training``    :func:`train_distributed`, the loop of ``pipeline.train`` per rank
==============  ==============================================================

Nothing here is imported by ``import pipeline``; ``pipeline.train`` imports ``world`` only.
"""
