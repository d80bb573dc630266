"""One rule for the repo id, in 05 (the card downloads from it) and 06 (the commit goes
there), and 06's fix for a stage staged for another repo rebuilds that very stage."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest
import torch

from localhub import LocalHub
from pipeline.errors import RepoIdError
from pipeline.repo_ids import hub_repo_id

from support import REPO, one_line_error, run_python, script_env

MODEL_PAGES = [
    ("me/tiny-bert", "me/tiny-bert"),
    ("https://huggingface.co/me/tiny-bert", "me/tiny-bert"),
    ("https://huggingface.co/me/tiny-bert/", "me/tiny-bert"),
    ("http://huggingface.co/me/tiny-bert", "me/tiny-bert"),
    ("https://www.huggingface.co/me/tiny-bert", "me/tiny-bert"),
    ("huggingface.co/me/tiny-bert", "me/tiny-bert"),
    ("https://hf.co/me/tiny.bert_2", "me/tiny.bert_2"),
    ("https://huggingface.co/me/tiny-bert/tree/main", "me/tiny-bert"),
    ("https://huggingface.co/me/tiny-bert/tree/v1.0/code", "me/tiny-bert"),
    ("https://huggingface.co/me/tiny-bert/blob/main/README.md", "me/tiny-bert"),
    ("https://huggingface.co/me/tiny-bert/resolve/main/config.json", "me/tiny-bert"),
    ("https://huggingface.co/me/tiny-bert/discussions/3", "me/tiny-bert"),
    ("https://huggingface.co/me/tiny-bert?library=transformers", "me/tiny-bert"),
    ("https://huggingface.co/me/tiny-bert#model-card", "me/tiny-bert"),
]
# (address, what the one line must call it)
NOT_MODEL_PAGES = [
    ("https://huggingface.co/datasets/squad", "is a dataset's page, not a model repo's"),
    ("https://huggingface.co/datasets/me/x", "is a dataset's page, not a model repo's"),
    ("https://huggingface.co/spaces/gradio", "is a Space's page, not a model repo's"),
    ("https://huggingface.co/spaces/me/demo/tree/main", "is a Space's page, not a model repo's"),
    ("https://huggingface.co/docs/hub/models-uploading", "is a documentation page, not a model repo's"),
    ("https://huggingface.co/models", "is the models listing, not a model repo's"),
    ("https://huggingface.co/models?pipeline_tag=text-generation", "is the models listing"),
    ("https://huggingface.co/settings/tokens", "is an account settings page, not a model repo's"),
    ("https://huggingface.co/organizations/acme/settings", "is an organization's settings page"),
    ("https://huggingface.co/papers/1706.03762", "is a paper's page, not a model repo's"),
    ("https://huggingface.co/collections/me/picks", "is a collection's page, not a model repo's"),
    ("https://huggingface.co/alice", "is the profile page of the user or organization 'alice'"),
    ("https://hf.co/acme/", "is the profile page of the user or organization 'acme'"),
    ("https://huggingface.co", "is the Hub's front page, not a model repo's"),
    ("https://huggingface.co/", "is the Hub's front page, not a model repo's"),
    ("https://huggingface.co/me/x/files", "is not the address of a model repo's page"),
    ("http://127.0.0.1:8080/me/x", "is an address, but not of a page on huggingface.co"),
    ("https://github.com/me/x", "is an address, but not of a page on huggingface.co"),
]


@pytest.mark.parametrize("text, expected", MODEL_PAGES)
def test_a_repo_id_or_a_model_repos_page_gives_the_id(text, expected):
    assert hub_repo_id(text) == expected


@pytest.mark.parametrize("text, what", NOT_MODEL_PAGES)
def test_any_other_page_of_the_hub_is_refused_in_one_line_that_says_what_it_is_and_what_to_write(text, what):
    with pytest.raises(RepoIdError) as refused:
        hub_repo_id(text)
    line = str(refused.value)
    assert line.startswith(f"--repo-id {text!r} {what}") and "\n" not in line, line
    assert "'namespace/name'" in line or "/NAME'" in line, line  # what to write instead


@pytest.mark.parametrize("text", ["me/tiny bert", "me/tiny-bert/", "me//x", "me/..x", "me/x.git", "a/b/c"])
def test_an_invalid_id_is_refused_by_the_hub_clients_rule(text):
    with pytest.raises(RepoIdError, match=r"is not a valid Hub repo id: use 'namespace/name'"):
        hub_repo_id(text)


@pytest.mark.parametrize("text", ["gpt2", "tiny-bert"])
def test_a_bare_name_is_refused_since_the_hub_would_read_it_as_a_repo_of_its_own(text):
    with pytest.raises(RepoIdError, match=r"names no namespace: use 'namespace/name'"):
        hub_repo_id(text)


def test_05_refuses_an_invalid_repo_id_before_any_work_and_stages_a_repo_pages_id(evaluated_run, run_copy):
    run = run_copy(evaluated_run)
    for bad in ("me/tiny bert", "me/tiny-bert/", "tiny-bert", "https://huggingface.co/datasets/me/tiny-bert"):
        line = run.refused("05_stage.py", "--repo-id", bad)
        assert f"--repo-id {bad!r}" in line, line
        assert not run.stage.exists()
    run.ok("05_stage.py", "--repo-id", "https://huggingface.co/me/tiny-bert")
    assert json.loads((run.stage / "meta.json").read_text())["repo_id"] == "me/tiny-bert"
    card = (run.stage / "README.md").read_text()
    assert 'repo_id = "me/tiny-bert"' in card and "huggingface.co/me" not in card


def test_06_takes_the_same_repo_page_address_and_refuses_other_pages_before_any_request(
    staged_run, run_copy, tmp_path
):
    run = run_copy(staged_run)
    run.ok("05_stage.py", "--repo-id", "me/tiny-bert")
    with LocalHub(tmp_path / "hub", token="t") as hub:
        for other in ("https://huggingface.co/spaces/me/tiny-bert", "https://huggingface.co/me", "tiny-bert"):
            line = run.refused("06_publish.py", "--repo-id", other, "--dry-run", "--endpoint", hub.url)
            assert line.startswith(f"error: --repo-id {other!r} "), line
        assert hub.request_counts() == {}
        page = "https://huggingface.co/me/tiny-bert/tree/main"
        result = run.ok("06_publish.py", "--repo-id", page, "--dry-run", "--endpoint", hub.url)
    assert "dry run: no write request was sent" in result.stdout  # the stage's repo: the address named it


def test_05_from_folder_refuses_a_bare_name_and_stages_a_model_page_as_its_id(tmp_path):
    """A folder another tool wrote (safetensors weights beside a config.json): the card's
    snippet names the repo id, so 05 --from-folder applies the same rule as 05 and 06."""
    from safetensors.torch import save_file

    folder, stage = tmp_path / "saved", tmp_path / "stage"
    folder.mkdir()
    save_file({"layer.weight": torch.ones(2, 2)}, folder / "model.safetensors")
    (folder / "config.json").write_text('{"width": 2}')

    def stage_as(repo_id: str):
        args = ["--from-folder", str(folder), "--stage", str(stage), "--repo-id", repo_id]
        return run_python([REPO / "scripts" / "05_stage.py", *args], cwd=tmp_path, env=script_env())

    for bare in ("tiny-net", "https://huggingface.co/datasets/you/tiny-net"):
        line = one_line_error(stage_as(bare))
        assert line.startswith(f"error: --repo-id {bare!r} "), line
        assert not stage.exists()
    staged = stage_as("https://hf.co/you/tiny-net/")
    assert staged.returncode == 0, staged.stderr
    assert json.loads((stage / "meta.json").read_text())["repo_id"] == "you/tiny-net"
    assert '"you/tiny-net"' in (stage / "README.md").read_text()


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
    # Without 05's record of its command beside the stage (a stage built from Python), 06's own
    # flags name the stage (test_hints: the record, when there is one).
    (run.root / ".mine.staged-by.json").unlink()
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
