"""Per-sample randomness: a sample's random draws are a function of (seed, epoch, index) only.

Before the pipeline fetches sample ``index`` of epoch ``epoch`` (a map-style dataset's
``__getitem__``, or the next item of a stream, whose index is its position in the pass),
it seeds, in whichever process fetches it::

    words = numpy.random.SeedSequence([training.seed, epoch, index]).generate_state(3, numpy.uint64)
    random.seed(words[0]); numpy.random.seed(words[1] % 2**32); torch CPU generator.manual_seed(words[2])

So augmentation noise is the same with 0 or 8 DataLoader workers, on any rank of any world
size, before or after a resume. In the training process the three global generators are
saved before a batch is fetched and put back after it (:func:`isolated_rng`): fetching
consumes nothing of the training streams (dropout, the run's own draws).
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import torch

__all__ = ["seed_sample", "isolated_rng"]


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed Python's ``random``, NumPy's legacy global state and torch's CPU generator for one
    sample (the rule in the module docstring). CUDA generators are left alone: a sample is
    prepared on the CPU, and the training process's CUDA streams are the model's."""
    words = np.random.SeedSequence([seed, epoch, index]).generate_state(3, dtype=np.uint64)
    random.seed(int(words[0]))
    np.random.seed(int(words[1]) % 2**32)
    torch.default_generator.manual_seed(int(words[2]))


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Run a block that reseeds the global generators, then restore the three states it may
    change: the caller's streams continue as if the block had not run."""
    python, legacy, cpu = (
        random.getstate(),
        np.random.get_state(legacy=False),
        torch.default_generator.get_state(),
    )
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(legacy)
        torch.default_generator.set_state(cpu)
