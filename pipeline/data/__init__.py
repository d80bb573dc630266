"""Training inputs: prepared files, the task data, the one source of order, and the feeds.

==============  ===================================================================
``prepared``    script 01's folder and its SHA-256 manifest; :func:`load_task_data`
``task``        :class:`TaskData`: ``get_batch``, a map-style ``train_dataset``, or a stream
``sampler``     :class:`EpochSampler`: each global batch's indices, saved and resumed
``seeding``     per-sample randomness from (seed, epoch, index)
``feed_base``   :class:`Feed`, what every feed is to the loop and the checkpoint
``feed``        one batch per step: ``get_batch``, or a ``DataLoader`` with workers
``stream``      a ``train_iterable`` batched, split per rank, its position saved as JSON
``failures``    the task's code failing or hanging while a batch is read, in one line
==============  ===================================================================

The user's guide is docs/data.md.
"""

from .feed import make_feed
from .feed_base import Feed, to_device
from .prepared import load_manifest, load_task_data, prepare_data
from .sampler import EpochSampler, Sampler, batches_per_epoch, clone_sampler, epochs_done, make_sampler
from .seeding import isolated_rng, seed_sample
from .task import BATCHES, DATASET, STREAM, InputForm, TaskData, describe_inputs, input_mode

__all__ = [
    "InputForm",
    "BATCHES",
    "DATASET",
    "STREAM",
    "TaskData",
    "Sampler",
    "EpochSampler",
    "Feed",
    "prepare_data",
    "load_manifest",
    "load_task_data",
    "make_sampler",
    "batches_per_epoch",
    "epochs_done",
    "clone_sampler",
    "make_feed",
    "to_device",
    "input_mode",
    "describe_inputs",
    "seed_sample",
    "isolated_rng",
]
