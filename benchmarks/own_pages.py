"""What owning the hashed bytes costs: the primitives a verified load can be built from, side by side.

    python benchmarks/own_pages.py [--mb 400,200] [--reps 5]

Files of random bytes (one per ``--mb`` value, hashed side by side as a checkpoint's two
files are) are written beside the repository, fsynced, and dropped from the page cache
before every candidate. Each candidate hashes every byte with SHA-256 and returns buffers
that a loader would view as tensors; every byte is then read once (a reduction), as
training would. Candidates:

- ``shared map``: hash a private map without copying (what the loader before issue 10 did;
  a writer to the file can change the bytes after they were hashed);
- ``own pages (COW)``: ``MADV_POPULATE_WRITE`` each 8 MiB of the private map, then hash it
  (the loader now: the kernel copies each page from the page cache into a page of ours);
- ``readinto new buffer``: ``posix_fadvise(WILLNEED)``, then ``readinto`` 8 MiB at a time
  into one anonymous buffer, hashing each chunk after it lands (a fresh page is zeroed,
  then the bytes are copied in);
- ``readinto, reader thread``: the same with reading and hashing in two threads.

Printed: medians, and each candidate / shared map, paired per repetition. A benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

HERE = Path(__file__).resolve().parents[1]
CHUNK = 8 * 1024 * 1024
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def _private_map(path: Path) -> mmap.mmap:
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    mapped.madvise(mmap.MADV_WILLNEED)
    return mapped


def shared_map(path: Path):
    mapped, digest = _private_map(path), hashlib.sha256()
    with memoryview(mapped) as view:
        for start in range(0, len(view), CHUNK):
            digest.update(view[start:start + CHUNK])
    return mapped


def own_pages(path: Path):
    mapped, digest = _private_map(path), hashlib.sha256()
    with memoryview(mapped) as view:
        for start in range(0, len(view), CHUNK):
            stop = min(start + CHUNK, len(view))
            mapped.madvise(_MADV_POPULATE_WRITE, start, stop - start)
            digest.update(view[start:stop])
    return mapped


def _readinto(path: Path, *, thread: bool):
    size = path.stat().st_size
    buffer, digest = mmap.mmap(-1, size), hashlib.sha256()
    starts = range(0, size, CHUNK)
    ready = threading.Semaphore(0)

    def read() -> None:
        with open(path, "rb", buffering=0) as handle, memoryview(buffer) as view:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
            for start in starts:
                stop = min(start + CHUNK, size)
                while start < stop:
                    start += handle.readinto(view[start:stop])
                ready.release()

    if thread:
        reader = threading.Thread(target=read)
        reader.start()
    else:
        read()
    with memoryview(buffer) as view:
        for start in starts:
            ready.acquire()
            digest.update(view[start:start + CHUNK])
    if thread:
        reader.join()
    return buffer


CANDIDATES: dict[str, Callable[[Path], object]] = {
    "shared map": shared_map,
    "own pages (COW)": own_pages,
    "readinto new buffer": lambda path: _readinto(path, thread=False),
    "readinto, reader thread": lambda path: _readinto(path, thread=True),
}


def _run(candidate: Callable[[Path], object], paths: list[Path]) -> float:
    for path in paths:
        _evict(path)
    results: dict[Path, object] = {}
    start = time.perf_counter()
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, candidate(p))) for p in paths]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for buffer in results.values():
        np.frombuffer(buffer, dtype=np.uint8).max()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", default="400,200", help="file sizes in MiB, hashed side by side")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in CANDIDATES}
    with tempfile.TemporaryDirectory(dir=HERE.parent) as folder:
        paths = []
        for index, mb in enumerate(int(m) for m in args.mb.split(",")):
            path = Path(folder) / f"file{index}.bin"
            with open(path, "wb") as handle:
                for _ in range(mb):
                    handle.write(os.urandom(1024 * 1024))
                handle.flush()
                os.fsync(handle.fileno())
            paths.append(path)
        for rep in range(args.reps):
            order = list(CANDIDATES) if rep % 2 == 0 else list(reversed(CANDIDATES))
            for name in order:
                times[name].append(_run(CANDIDATES[name], paths))
    print(f"command: {' '.join(sys.argv)}; load average {os.getloadavg()[0]:.1f}")
    print("| candidate | median s | / shared map (paired median) |")
    print("| --- | ---: | ---: |")
    for name, values in times.items():
        paired = statistics.median(v / s for v, s in zip(values, times["shared map"]))
        print(f"| {name} | {statistics.median(values):.3f} | {paired:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
