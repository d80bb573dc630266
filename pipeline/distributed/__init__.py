"""Training under torchrun (DDP, FSDP2): the launch's side of :class:`pipeline.world.World`.

==============  ==============================================================
``world``       :class:`LaunchWorld`: this rank, the process groups, agreement on errors and
                signals, DDP or FSDP2 around the model, the launcher watchdog
``launch``      :func:`joined`: the world a run trains in, a launch joined and left around it
==============  ==============================================================

The run itself is :func:`pipeline.train.train`'s, the same in one process and on each rank.
Saving and restoring a distributed checkpoint is ``pipeline.checkpoint.distributed`` and ``.dist_restore``;
reading one (verification, shard coverage, consolidated weights) is
:func:`pipeline.checkpoint.load_checkpoint`, as for any checkpoint. Nothing here is
imported by ``import pipeline``; ``world`` (and torch.distributed.checkpoint with it) only
by a launch.
"""
