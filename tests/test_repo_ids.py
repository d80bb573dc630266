"""One rule for the repo id, in 05 (the card downloads from it) and 06 (the commit goes
there), and 06's fix for a stage staged for another repo rebuilds that very stage."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest

from localhub import LocalHub
from pipeline.errors import RepoIdError
from pipeline.repo_ids import hub_repo_id

from support import REPO, one_line_error, run_python, script_env


@pytest.mark.parametrize(
    "text, expected",
    [
        ("me/tiny-bert", "me/tiny-bert"),
        ("https://huggingface.co/me/tiny-bert", "me/tiny-bert"),
        ("https://huggingface.co/me/tiny-bert/", "me/tiny-bert"),
        ("https://hf.co/me/tiny.bert_2", "me/tiny.bert_2"),
        ("me/tiny bert", None),
        ("me/tiny-bert/", None),
        ("me//x", None),
        ("me/..x", None),
        ("https://huggingface.co/datasets/me/x", None),
        ("https://huggingface.co/me/x/tree/main", None),
        ("http://127.0.0.1:8080/me/x", None),
    ],
)
def test_a_repo_id_is_checked_by_the_hub_clients_rule_and_a_repo_page_gives_its_id(text, expected):
    if expected is None:
        with pytest.raises(RepoIdError, match=r"is not a valid Hub repo id: use 'namespace/name'"):
            hub_repo_id(text)
    else:
        assert hub_repo_id(text) == hub_repo_id(text, namespace_required=True) == expected
    assert hub_repo_id("gpt2") == "gpt2"  # 06 may create it in the token's namespace
    with pytest.raises(RepoIdError, match="names no namespace"):
        hub_repo_id("gpt2", namespace_required=True)


def test_05_refuses_an_invalid_repo_id_before_any_work_and_stages_a_repo_pages_id(evaluated_run, run_copy):
    run = run_copy(evaluated_run)
    for bad in ("me/tiny bert", "me/tiny-bert/", "tiny-bert"):
        line = run.refused("05_stage.py", "--repo-id", bad)
        assert f"--repo-id {bad!r}" in line, line
        assert not run.stage.exists()
    run.ok("05_stage.py", "--repo-id", "https://huggingface.co/me/tiny-bert")
    assert json.loads((run.stage / "meta.json").read_text())["repo_id"] == "me/tiny-bert"
    card = (run.stage / "README.md").read_text()
    assert 'repo_id = "me/tiny-bert"' in card and "huggingface.co/me" not in card


def test_06_takes_the_same_repo_page_address(staged_run, run_copy, tmp_path):
    run = run_copy(staged_run)
    run.ok("05_stage.py", "--repo-id", "me/tiny-bert")
    with LocalHub(tmp_path / "hub", token="t") as hub:
        page = "https://huggingface.co/me/tiny-bert"
        result = run.ok("06_publish.py", "--repo-id", page, "--dry-run", "--endpoint", hub.url)
    assert "dry run: no write request was sent" in result.stdout  # the stage's repo: the address named it


def test_06s_fix_for_a_stage_staged_for_another_repo_rebuilds_that_stage_as_printed(
    staged_run, run_copy, tmp_path, request
):
    """The stage is not the config's default one (--stage); the printed 05 command keeps it
    (test_charlm: and the --config 06 was given), so, run as printed, it rebuilds that stage
    for the repo and leaves the default stage alone."""
    run = run_copy(staged_run)
    shutil.copy(REPO / "config.yaml", run.root / "config.yaml")  # 05 and 06 find it as the default
    default_stage = (run.stage / "meta.json").read_bytes()

    def script(name: str, *args: str):
        return run_python([REPO / "scripts" / name, *args], cwd=run.root, env=script_env())

    assert script("05_stage.py", "--stage", "mine", "--repo-id", "me/first").returncode == 0
    hub = LocalHub(tmp_path / "hub", token="t").start()
    request.addfinalizer(hub.stop)
    publish = ("--stage", "mine", "--repo-id", "me/second", "--dry-run", "--endpoint", hub.url)
    line = one_line_error(script("06_publish.py", *publish))
    printed = line.split("restage with ", 1)[1].split(", or pass --force-repo-id")[0]
    assert "--stage mine" in printed, printed
    rerun = run_python(shlex.split(printed)[1:], cwd=run.root, env=script_env())
    assert rerun.returncode == 0, rerun.stderr
    assert json.loads((run.root / "mine" / "meta.json").read_text())["repo_id"] == "me/second"
    assert (run.stage / "meta.json").read_bytes() == default_stage
    assert script("06_publish.py", *publish).returncode == 0
