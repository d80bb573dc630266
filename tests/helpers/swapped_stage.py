"""05 --from-folder with one file of the folder swapped right after the survey looked at it.

    python -B tests/helpers/swapped_stage.py FOLDER STAGE NAME KIND [TARGET]

Runs what ``scripts/05_stage.py --from-folder FOLDER --stage STAGE`` runs (through
``run_main``: one ``error:`` line and the exit code), with ``survey_folder`` wrapped from
here, the test's side: once the real survey has returned, ``NAME`` of the folder is replaced
by KIND (``link``: a symbolic link to TARGET, a private file; ``fifo``: a FIFO nobody writes;
``device``: a character device like /dev/zero, which never ends; ``other``: another file of
the same size moved over it; ``grown``: the same file appended to; NAME ``.`` and
``folder``: the whole folder replaced by a copy). So the swap lands between the survey and the read every time, on the real
file system; nothing in ``pipeline/`` knows about it.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path


def swap(path: Path, kind: str, target: str | None) -> None:
    size = path.stat().st_size
    if kind == "grown":  # the same file, appended to in place
        with open(path, "ab") as out:
            out.write(b" " * 7)
        return
    if kind == "folder":  # the whole folder moved away, a copy put in its place
        shutil.copytree(path, path.with_name(".copy"))
        path.rename(path.with_name(".moved"))
        path.with_name(".copy").rename(path)
        return
    if kind == "other":  # moved over it (mv), as another program would replace a file
        other = path.with_name(".other")
        other.write_bytes(b"{" + b" " * (size - 2) + b"}")
        os.replace(other, path)
        return
    path.unlink()
    if kind == "link":
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        zero = os.stat("/dev/zero")
        os.mknod(path, stat.S_IFCHR | 0o666, zero.st_rdev)
    else:
        raise SystemExit(f"unknown kind {kind}")


def main() -> int:
    folder, stage_dir, name, kind = sys.argv[1:5]
    target = sys.argv[5] if len(sys.argv) > 5 else None
    import pipeline.stage.from_folder as from_folder

    real = from_folder.survey_folder

    def survey_then_swap(surveyed: Path):
        inventory = real(surveyed)
        swap(surveyed / name, kind, target)
        return inventory

    from_folder.survey_folder = survey_then_swap
    from_folder.stage_folder(
        from_folder.folder_config({}), from_folder.FolderStage(folder=folder, stage_dir=stage_dir)
    )
    print("staged")
    return 0


if __name__ == "__main__":
    from pipeline.cli import run_main

    run_main(main)
