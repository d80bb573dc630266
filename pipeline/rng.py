"""Every random number generator a run consumes: seeding, capture, restore, and a peek at
the next draw that never disturbs the live generators."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from .errors import StateMismatch

__all__ = [
    "seed_everything",
    "derive_rank_rng",
    "capture_rng",
    "restore_rng",
    "peek_next_draws",
    "RNG_FAMILIES",
]

RNG_FAMILIES = ("python", "numpy_generator", "numpy_legacy", "torch_cpu", "torch_cuda")


def seed_everything(seed: int) -> np.random.Generator:
    """Seed Python, NumPy's legacy global state and torch (CPU and CUDA); return the run's
    own NumPy ``Generator(PCG64)``, which the data sampler draws its permutations from."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return np.random.Generator(np.random.PCG64(seed))


def derive_rank_rng(seed: int, step: int, rank: int) -> None:
    """Seed this rank's own RNG families (Python, NumPy's legacy state, torch CPU and CUDA)
    from ``SeedSequence([seed, step, rank])``: at the start of a run (step 0) and when a
    resume changes the world size. The run's NumPy ``Generator`` orders the data and is the
    same on every rank, so it is not touched here."""
    words = np.random.SeedSequence([seed, step, rank]).generate_state(4, dtype=np.uint64)
    random.seed(int(words[0]))
    np.random.seed(int(words[1]) % 2**32)
    torch.manual_seed(int(words[2]))  # also seeds every CUDA device


def _cuda_present() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def capture_rng(generator: np.random.Generator) -> dict[str, Any]:
    """The full state of every family. Python's and NumPy's states are plain ints and
    strings (the legacy key is an array), torch's are byte tensors."""
    return {
        "python": random.getstate(),
        "numpy_generator": generator.bit_generator.state,
        "numpy_legacy": np.random.get_state(legacy=False),
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": list(torch.cuda.get_rng_state_all()) if _cuda_present() else [],
    }


def restore_rng(state: dict[str, Any], generator: np.random.Generator, *, need_cuda: bool) -> None:
    """Restore every family. Call last, after every construction that consumes randomness."""
    missing = [family for family in RNG_FAMILIES if family not in state]
    if missing:
        raise StateMismatch(f"saved RNG state lacks {', '.join(missing)}")
    random.setstate(state["python"])
    saved_bitgen = state["numpy_generator"]["bit_generator"]
    if saved_bitgen != type(generator.bit_generator).__name__:
        raise StateMismatch(
            f"saved NumPy generator is {saved_bitgen}, this run uses {type(generator.bit_generator).__name__}"
        )
    generator.bit_generator.state = state["numpy_generator"]
    np.random.set_state(state["numpy_legacy"])
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state["torch_cuda"]
    if cuda_states and _cuda_present():
        if len(cuda_states) != torch.cuda.device_count():
            if need_cuda:
                raise StateMismatch(
                    f"checkpoint holds RNG states of {len(cuda_states)} CUDA devices, "
                    f"this machine has {torch.cuda.device_count()}: resume on the same "
                    "device count, or set CUDA_VISIBLE_DEVICES"
                )
        else:
            torch.cuda.set_rng_state_all(cuda_states)
    elif need_cuda and not cuda_states:
        raise StateMismatch("the run trains on CUDA but the checkpoint holds no CUDA RNG state")


def peek_next_draws(generator: np.random.Generator) -> dict[str, Any]:
    """The next value each family would produce, drawn from copies of the live states."""
    python_copy = random.Random()
    python_copy.setstate(random.getstate())
    numpy_copy = np.random.Generator(type(generator.bit_generator)())
    numpy_copy.bit_generator.state = generator.bit_generator.state
    legacy_copy = np.random.RandomState()
    legacy_copy.set_state(np.random.get_state())
    torch_copy = torch.Generator()
    torch_copy.set_state(torch.get_rng_state())
    draws: dict[str, Any] = {
        "python": python_copy.random(),
        "numpy_generator": float(numpy_copy.random()),
        "numpy_legacy": float(legacy_copy.random_sample()),
        "torch_cpu": float(torch.rand(1, generator=torch_copy, dtype=torch.float64)),
    }
    if _cuda_present():
        cuda = []
        for index, saved in enumerate(torch.cuda.get_rng_state_all()):
            device_copy = torch.Generator(device=f"cuda:{index}")
            device_copy.set_state(saved)
            cuda.append(float(torch.rand(1, generator=device_copy, device=f"cuda:{index}")))
        draws["torch_cuda"] = cuda
    return draws
