"""A new virtual environment holding exactly what a ``pip install`` line would install, offline.

``pip install`` from the index takes one to two minutes here and needs the network; the
suite cannot pay that. What pip installs is the requirements plus their declared
dependencies, transitively: :func:`fresh_venv` builds that closure from the distributions
already installed in this interpreter's environment (same versions, checked against each
specifier), links their files into a new ``venv`` and writes their console scripts, as pip
does. A dependency a package forgets to declare (model-signing 1.1.1's ``pyopenssl``) is
missing here exactly as after pip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def _closure(requirements: list[str]) -> list[metadata.Distribution]:
    found: dict[str, metadata.Distribution] = {}
    pending = [(Requirement(text), frozenset()) for text in requirements]
    while pending:
        requirement, extras = pending.pop()
        environment = [{"extra": extra} for extra in extras] or [{"extra": ""}]
        if requirement.marker is not None and not any(
            requirement.marker.evaluate(env) for env in environment
        ):
            continue
        name = canonicalize_name(requirement.name)
        dist = metadata.distribution(requirement.name)  # PackageNotFoundError: cannot be emulated here
        if dist.version not in requirement.specifier:
            raise AssertionError(
                f"{requirement} asked, {dist.version} installed: cannot build this environment"
            )
        if name in found:
            continue
        found[name] = dist
        pending += [(Requirement(text), frozenset(requirement.extras)) for text in dist.requires or ()]
    return list(found.values())


def fresh_venv(folder: Path, requirements: list[str]) -> Path:
    """A new venv in ``folder`` with ``requirements`` and their dependencies; its ``bin/``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    here = Path(sysconfig.get_path("purelib"))
    for dist in _closure(requirements):
        for file in dist.files or ():
            source = Path(dist.locate_file(file))
            if not source.is_file() or not source.resolve().is_relative_to(here.resolve()):
                continue  # scripts (written below) and files pip does not link
            target = purelib / source.relative_to(here)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                os.symlink(source, target)
        for entry in dist.entry_points.select(group="console_scripts"):
            module, _, attr = entry.value.partition(":")
            script = folder / "bin" / entry.name
            script.write_text(
                f"#!{python}\nimport sys\nfrom {module} import {attr.split('.')[0]}\nsys.exit({attr}())\n"
            )
            script.chmod(0o755)
    return folder / "bin"
