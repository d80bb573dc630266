"""Training under torchrun (DDP, FSDP2) with pickle-free distributed checkpoints.

==============  ==============================================================
``world``       this rank, the process group, agreement on errors and signals
``training``    :func:`train_distributed`, the loop of ``pipeline.train`` per rank
==============  ==============================================================

Saving and restoring a distributed checkpoint is ``pipeline.checkpoint.distributed``;
reading one (verification, shard coverage, consolidated weights) is
:func:`pipeline.checkpoint.load_checkpoint`, as for any checkpoint. Nothing here is
imported by ``import pipeline``; ``pipeline.train`` imports ``world`` only.
"""
