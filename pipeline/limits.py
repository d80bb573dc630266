"""What this machine lets a run start: CPUs, and room for more threads and processes (torch-free).

A count of the config that becomes threads or processes (``training.threads``: the OpenMP
threads of every matmul; ``data.num_workers``: DataLoader processes, each with a thread of its
own) is checked here before any of them starts, against two things:

- the CPUs this process may use (``os.sched_getaffinity``): more than :data:`PER_CPU` per CPU
  (and more than :data:`FLOOR` on a small machine) only slows a run down, and a typo such as
  ``training.threads=100000`` would otherwise end in a crash inside OpenMP (libgomp aborts the
  process when a thread cannot start, with no Python error to catch);
- the room left for new tasks (threads and processes count alike): the kernel's ``pid_max``
  and ``threads-max``, the cgroup's ``pids.max`` (a container's), and ``RLIMIT_NPROC``
  (``ulimit -u``, per user; the kernel does not apply it to root) less what this user runs.

A count that does not fit is refused in one line naming the key, the number the machine
allows and why. Running out anyway later (another program took the room) is one ``error:``
line too (:func:`out_of_tasks`, :func:`pipeline.cli.run_main`).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from .errors import MachineLimit

__all__ = ["FLOOR", "PER_CPU", "HEADROOM", "usable_cpus", "most_threads", "task_room", "check_counts"]

PER_CPU = 8
"""Threads (or worker processes) per usable CPU beyond which a count is refused."""
FLOOR = 64
"""The ceiling on a machine of fewer than ``FLOOR / PER_CPU`` CPUs: a run recorded with up to
this many threads still resumes on a small machine (slowly, but bitwise)."""
HEADROOM = 8
"""Threads the pipeline itself may start besides the counts (a background save, its copy
helper, watchdogs), added to the hashing pool's one per CPU."""

# CAP_SYS_ADMIN and CAP_SYS_RESOURCE: either exempts a process from RLIMIT_NPROC.
_NPROC_EXEMPT_CAPS = (1 << 21) | (1 << 24)


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def most_threads() -> int:
    """The largest thread count (or worker count) a run may ask for on this machine."""
    return max(FLOOR, PER_CPU * usable_cpus())


def _read_int(path: Path | str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _total_tasks() -> int | None:
    """Threads and processes running on the machine (``/proc/loadavg``'s 4th field)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        return None


def _pids_cgroups() -> list[Path]:
    """The folders of this process's pids cgroup and its ancestors (v1 ``pids`` or v2)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    folders = []
    for line in lines:
        _, controllers, where = line.split(":", 2)
        if controllers == "pids":
            base = Path("/sys/fs/cgroup/pids")
        elif controllers == "":
            base = Path("/sys/fs/cgroup")
        else:
            continue
        folder = base / where.lstrip("/")
        while True:
            folders.append(folder)
            if folder == base:
                break
            folder = folder.parent
    return folders


def _nproc_exempt() -> bool:
    if os.getuid() == 0:
        return True
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) & _NPROC_EXEMPT_CAPS)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _tasks_of(uid: int) -> int:
    """Threads of every process whose real user is ``uid`` (what RLIMIT_NPROC counts)."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue  # ended, or not ours to read
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        try:
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (KeyError, ValueError, IndexError):
            continue
    return count


def task_room() -> tuple[int, str] | None:
    """``(how many more threads and processes may start, the limit that says so)``, the
    tightest of the kernel's, the cgroup's and this user's; ``None`` where none is known."""
    rooms: list[tuple[int, str]] = []
    total = _total_tasks()
    if total is not None:
        for name in ("pid_max", "threads-max"):
            most = _read_int(f"/proc/sys/kernel/{name}")
            if most is not None:
                rooms.append((most - total, f"the kernel's {name} of {most}, {total} running"))
    for folder in _pids_cgroups():
        most, current = _read_int(folder / "pids.max"), _read_int(folder / "pids.current")
        if most is not None and current is not None:
            rooms.append((most - current, f"the cgroup's pids.max of {most}, {current} in use"))
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and not _nproc_exempt():
        used = _tasks_of(os.getuid())
        rooms.append(
            (soft - used, f"this user's limit of {soft} processes and threads (ulimit -u), {used} in use")
        )
    return min(rooms) if rooms else None


def check_counts(threads: int, workers: int = 0, *, key: str = "training.threads") -> None:
    """Refuse (:class:`MachineLimit`, one line) ``threads`` intra-op threads (``key`` names
    where the count comes from) and ``workers`` DataLoader processes that this machine cannot
    honour; nothing has started yet."""
    ceiling = most_threads()
    for name, count in ((key, threads), ("data.num_workers", workers)):
        if count > ceiling:
            raise MachineLimit(
                f"{name}={count} is more than this machine can run usefully: {usable_cpus()} CPUs are usable by "
                f"this process, and at most {ceiling} is allowed ({PER_CPU} per CPU, or {FLOOR})"
                + ("" if name.startswith("the ") else f"; set {name} to at most {usable_cpus()} or so")
            )
    room = task_room()
    # The OpenMP threads besides this one, each worker and its queue's thread, the pipeline's own.
    needed = (threads - 1) + 2 * workers + HEADROOM + usable_cpus()
    if room is not None and needed > room[0]:
        asked = f"{key}={threads}" + (f" and data.num_workers={workers}" if workers else "")
        raise MachineLimit(
            f"{asked} need about {needed} more threads and processes, but only {max(room[0], 0)} may start "
            f"({room[1]}): lower them, stop other processes, or raise the limit"
        )
