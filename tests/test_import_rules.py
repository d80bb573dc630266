"""The import rules of docs/ARCHITECTURE.md, checked on the code itself.

- Other packages import ``pipeline.checkpoint`` only through its ``__init__``.
- ``localhub`` (the loopback Hub) imports nothing of ``pipeline``.
- The publish side (``pipeline.publishing`` and what it imports) never imports torch: statically,
  over every import statement of its closure, and for real, 06 --dry-run with torch impossible.
- No circle of imports among the modules of ``pipeline``: the imports go one way.

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
    "package", ["config", "data", "distributed", "entry", "integrations", "leaks", "publishing", "stage"]
)
def test_a_packages_docstring_names_every_module_in_it(package):
    """A module its package's map leaves out is one a maintainer does not find from there."""
    folder = REPO / "pipeline" / package
    text = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
    modules = sorted(path.stem for path in folder.glob("*.py") if path.stem != "__init__")
    assert modules and [name for name in modules if f"``{name}``" not in text] == [], text


# -- no circle of imports ---------------------------------------------------------------------


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def runtime_imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that an import statement of ``path`` (module ``module``)
    loads when it runs:
    at module level or inside a function (a lazy import defers a dependency, it does not
    remove it), but not under ``if TYPE_CHECKING:`` (never run). ``from pkg import name``
    loads ``pkg.name`` when that is a module, else ``pkg`` (its ``__init__``); the parent
    packages Python runs first are not counted (every submodule has them)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                for other in child.orelse:  # type: ignore[attr-defined]
                    visit_statement(other)
            else:
                visit_statement(child)

    def visit_statement(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        else:
            visit(node)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return (found & modules) - {module}


def import_cycles(files: dict[str, Path]) -> list[list[str]]:
    """Every circle of imports among ``files`` (``{module: path}``): the strongly connected
    components of the import graph with more than one module (Tarjan), each as a path that
    goes round it."""
    graph = {name: runtime_imports(path, name, set(files)) for name, path in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(_round(graph, sorted(component)))

    for name in sorted(graph):
        if name not in index:
            connect(name)
    return circles


def _round(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A path from the component's first module back to it, inside the component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for other in sorted(graph[node] & members):
            if other == start:
                return [*paths[node], start]
            if other not in paths:
                paths[other] = [*paths[node], other]
                todo.append(other)
    return component


def test_no_circle_of_imports_among_the_pipelines_modules():
    files = {module_name(p): p for p in python_files("pipeline")}
    circles = [" -> ".join(circle) for circle in import_cycles(files)]
    assert circles == [], circles


def test_the_circle_finder_finds_a_circle_through_a_lazy_import_and_not_through_type_checking(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import two\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import one\n"
        "def two():\n    from . import c\n"
    )
    (package / "c.py").write_text("import pkg.a\n")
    files = {f"pkg.{p.stem}": p for p in package.glob("*.py") if p.stem != "__init__"}
    reach = {name: runtime_imports(path, name, set(files)) for name, path in files.items()}
    assert reach == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert import_cycles(files) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    (package / "c.py").write_text("")
    assert import_cycles(files) == []
