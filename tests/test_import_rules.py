"""The import rules of docs/ARCHITECTURE.md, checked on the code itself.

- Other packages import ``pipeline.checkpoint`` only through its ``__init__``.
- ``localhub`` (the loopback Hub) imports nothing of ``pipeline``.
- The publish side (``pipeline.publishing`` and what it imports) never imports torch: statically,
  over every import statement of its closure, and for real, 06 --dry-run with torch impossible.

And the map the packages draw of themselves: each one's ``__init__`` names every module in it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from localhub import LocalHub

from support import REPO, TREE_PATH

TORCH_SIDE = ("torch", "matplotlib", "numpy", "safetensors.torch")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> list[str]:
    """Every module an import statement of ``path`` names, anywhere in the file, made absolute."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` may import a submodule: name both, the closure keeps what exists.
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return names


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (REPO / folder).rglob("*.py"))


def test_other_packages_import_the_checkpoint_package_only_through_its_init():
    offenders = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in python_files("pipeline", "scripts", "examples")
        if not path.is_relative_to(REPO / "pipeline" / "checkpoint")
        for name in imported_names(path)
        if name.startswith("pipeline.checkpoint.")
        and name.removeprefix("pipeline.checkpoint.") not in _checkpoint_exports()
    ]
    assert offenders == []


def _checkpoint_exports() -> set[str]:
    import pipeline.checkpoint

    return set(pipeline.checkpoint.__all__)


def test_localhub_imports_nothing_of_the_pipeline():
    offenders = [
        f"{path.relative_to(REPO)} imports {name}"
        for path in python_files("localhub")
        for name in imported_names(path)
        if name == "pipeline" or name.startswith("pipeline.")
    ]
    assert offenders == []


def publish_closure() -> dict[str, list[str]]:
    """``{module: names it imports}`` for every pipeline module the publish package reaches."""
    files = {module_name(p): p for p in python_files("pipeline")}
    todo = [name for name in files if name.startswith("pipeline.publishing")]
    seen: dict[str, list[str]] = {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = imported_names(files[name])
        todo += [n for n in seen[name] if n in files]
        # Importing pipeline.x.y runs pipeline/x/__init__.py first.
        todo += [n.rsplit(".", i)[0] for n in seen[name] if n in files for i in range(1, n.count("."))]
    return seen


def test_the_publish_side_never_imports_torch():
    closure = publish_closure()
    assert "pipeline.publishing.commit" in closure and "pipeline.audit" in closure  # the walk reached them
    offenders = [
        f"{module} imports {name}"
        for module, names in sorted(closure.items())
        for name in names
        if name.split(".")[0] in ("torch", "matplotlib") or name in TORCH_SIDE
    ]
    assert offenders == []


def test_publish_dry_run_works_where_torch_cannot_be_imported(staged_run, tmp_path):
    blocked = tmp_path / "blocked"
    for name in ("torch", "matplotlib"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked in this test')\n")
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{blocked}:{TREE_PATH}",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_DISABLE_XET": "1",
    }
    with LocalHub(tmp_path / "hub", token="t") as hub:
        result = subprocess.run(
            [
                sys.executable,
                str(REPO / "scripts" / "06_publish.py"),
                "--repo-id",
                "alice/m",
                "--endpoint",
                hub.url,
                "--stage",
                str(staged_run.stage),
                "--dry-run",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    assert "dry run: no write request was sent" in result.stdout
    # The blocker works: the same interpreter and path cannot import torch.
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert "torch is blocked in this test" in probe.stderr


@pytest.mark.parametrize(
    "package", ["config", "data", "distributed", "integrations", "leaks", "publishing", "stage"]
)
def test_a_packages_docstring_names_every_module_in_it(package):
    """A module its package's map leaves out is one a maintainer does not find from there."""
    folder = REPO / "pipeline" / package
    text = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
    modules = sorted(path.stem for path in folder.glob("*.py") if path.stem != "__init__")
    assert modules and [name for name in modules if f"``{name}``" not in text] == [], text
