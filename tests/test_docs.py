"""The documentation holds together: links resolve, the README stays a front door, the map is complete.

Reads files only (no torch, no subprocess): well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

from support import REPO

README_MAX_LINES = 300
MAP_MAX_LINE = 200
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
TRACKER = re.compile(r"issue ?#?[0-9]+", re.IGNORECASE)
MAP = REPO / "docs" / "ARCHITECTURE.md"


def pages() -> list[Path]:
    return [
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "examples").glob("*/README.md")),
    ]


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where a `](x)` is not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    slugs = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(REPO)}: ({target})"
        if not resolved.exists():
            broken.append(f"{where} names a missing file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{where} names a missing heading")
    return broken


def test_every_relative_link_and_anchor_in_the_docs_resolves():
    assert [line for page in pages() for line in broken_links(page)] == []


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "there.md").write_text("# A heading: `here`\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-heading-here) [gone](nowhere.md) [bad](there.md#elsewhere)\n"
        "`[code](nowhere.md)`\n```\n[block](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(page) == [
        "page.md: (nowhere.md) names a missing file",
        "page.md: (there.md#elsewhere) names a missing heading",
    ]


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES


def test_no_line_of_the_architecture_map_is_an_essay():
    long = [
        number
        for number, line in enumerate(MAP.read_text(encoding="utf-8").splitlines(), 1)
        if len(line) > MAP_MAX_LINE
    ]
    assert long == []


def test_the_docs_describe_what_is_not_tracker_history():
    found = [
        f"{page.relative_to(REPO)}: {match}"
        for page in pages()
        for match in TRACKER.findall(page.read_text(encoding="utf-8"))
    ]
    assert found == []


def mapped_modules(text: str) -> set[str]:
    """The module paths of the package tree (the first fenced block), from its indentation."""
    tree = FENCE.search(text).group(0).splitlines()[1:-1]
    folders: list[tuple[int, str]] = []
    paths = set()
    for line in tree:
        indent = len(line) - len(line.lstrip())
        names = line.split("  ")[0].strip() if indent == 0 else line.strip().split("  ")[0]
        folders = [(depth, name) for depth, name in folders if depth < indent]
        prefix = "".join(name for _, name in folders)
        for name in names.split(", "):
            if name.endswith("/"):
                folders.append((indent, name))
            else:
                paths.add(prefix + name)
    return paths


def test_the_architecture_map_names_every_module():
    mapped = mapped_modules(MAP.read_text(encoding="utf-8"))
    modules = {
        path.relative_to(REPO).as_posix()
        for package in ("pipeline", "localhub")
        for path in (REPO / package).rglob("*.py")
        if not (path.name == "__init__.py" and not path.read_text(encoding="utf-8").strip())
    }
    assert sorted(modules - mapped) == []


CONFIG_PAGE = REPO / "docs" / "configuration.md"
SECTION_HEADING = re.compile(r"^### `(\w+)`$")
TABLE_ROW = re.compile(r"^\| ([^|]+) \|")


def documented_keys(text: str) -> set[str]:
    """``section.key`` for every key named in the first column of the tables under a
    ``### `section``` heading (until the next heading)."""
    keys, section = set(), None
    for line in text.splitlines():
        if line.startswith("#"):
            match = SECTION_HEADING.match(line)
            section = match.group(1) if match else None
        elif section is not None and (row := TABLE_ROW.match(line)):
            keys.update(f"{section}.{name}" for name in re.findall(r"`(\w+)`", row.group(1)))
    return keys


def config_keys() -> set[str]:
    """Every key of the typed config, from its dataclasses (the YAML names, e.g. ``checkpoint.async``)."""
    import dataclasses
    import typing

    from pipeline.config import Config

    keys = set()
    for name, section in typing.get_type_hints(Config).items():
        if dataclasses.is_dataclass(section):
            keys.update(
                f"{name}.{field.metadata.get('key', field.name)}" for field in dataclasses.fields(section)
            )
    return keys


def test_the_configuration_page_names_every_key_of_the_typed_config_and_no_other():
    documented = documented_keys(CONFIG_PAGE.read_text(encoding="utf-8"))
    assert sorted(config_keys() - documented) == [], "keys missing from docs/configuration.md"
    assert sorted(documented - config_keys()) == [], "docs/configuration.md names keys the config lacks"
    assert {"checkpoint.async", "data.stream_split", "card.allow_leaks", "outputs.stage"} <= documented


def test_config_yaml_points_only_at_pages_and_headings_that_exist():
    """Its comments send the reader to pages by path (and heading anchor), which can be
    checked, never to a section named in prose ('README "Distributed"'), which cannot."""
    text = (REPO / "config.yaml").read_text(encoding="utf-8")
    cited = re.findall(r"(?<![\w/])((?:README|docs/[\w-]+)\.md)(#[\w-]+)?", text)
    assert cited, "config.yaml cites the docs"
    missing = [
        path + anchor
        for path, anchor in cited
        if not (REPO / path).is_file() or (anchor and anchor[1:] not in anchors(REPO / path))
    ]
    assert missing == [] and re.findall(r"README \"", text) == []
