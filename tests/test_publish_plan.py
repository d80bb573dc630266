"""06's plan and checks, in this process with exact values: the arguments checked before any
request, each staged file compared with the branch's (what the commit does with it), the plan as
06 prints it, and a Xet-stored file checked after landing. The plan of a real branch goes through
publish() against the loopback Hub of tests/test_publish.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import test_publish
from huggingface_hub import constants
from test_publish import api_for, publish_here, write_requests

from pipeline.audit import AuditedFile
from pipeline.errors import PublishError
from pipeline.publishing import format_plan
from pipeline.publishing.client import RemoteFile
from pipeline.publishing.plan import (
    PlannedFile,
    PublishPlan,
    _messages,
    check_receipt_dir,
    clean_prefix,
    compare,
    prepare_receipt_dir,
    resolve_endpoint,
)
from pipeline.publishing.xet import StagedXetHashes, check_landed

hf_env, hub, token_env, waits = (
    test_publish.hf_env,
    test_publish.hub,
    test_publish.token_env,
    test_publish.waits,
)

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


# -- the arguments --------------------------------------------------------------------------


def test_path_in_repo_is_a_plain_folder_ending_in_a_slash_and_anything_else_is_refused_naming_it():
    prefixes = {None: "", "": "", "/": "", "model": "model/", "/v1/model/": "v1/model/"}
    assert {given: clean_prefix(given) for given in prefixes} == prefixes
    # The refusal names the path as given, its outer slashes too.
    for bad in ("a/../b", "./model", "v1//model", "..", "/v1/../model/"):
        with pytest.raises(PublishError) as refused:
            clean_prefix(bad)
        assert str(refused.value) == (
            f"--path-in-repo {bad!r} must be a plain folder path such as 'model' or 'v1/model'"
        )


def test_the_endpoint_is_the_flag_else_hf_endpoint_else_the_clients_default_without_a_trailing_slash(
    monkeypatch,
):
    monkeypatch.setenv("HF_ENDPOINT", "https://env.example/")
    assert resolve_endpoint("https://flag.example/") == "https://flag.example"
    assert resolve_endpoint(None) == "https://env.example"
    monkeypatch.delenv("HF_ENDPOINT")
    assert resolve_endpoint(None) == constants.ENDPOINT.rstrip("/")


def test_a_receipt_folder_inside_the_stage_is_refused_naming_both_and_the_default_is_beside_the_stage(
    tmp_path,
):
    stage = tmp_path / "outputs" / "hub_stage"
    stage.mkdir(parents=True)
    assert check_receipt_dir(None, stage) == tmp_path / "outputs" / "hub_receipts"
    assert check_receipt_dir(tmp_path / "outputs", stage) == tmp_path / "outputs"  # above it: fine
    with pytest.raises(PublishError) as refused:
        check_receipt_dir(stage / "receipts", stage)
    assert str(refused.value) == (
        f"--receipt-dir {stage / 'receipts'} is inside the stage {stage}/, which is uploaded as it is: "
        "write receipts elsewhere (default: hub_receipts/ beside the stage)"
    )


def test_a_receipt_folder_inside_the_stage_is_refused_however_either_path_is_spelt(tmp_path, monkeypatch):
    """06's --stage and --receipt-dir come from a command line: relative to the working folder,
    absolute, or through a link. Whichever spelling, a receipt folder in the stage is refused (it
    would be uploaded by the next publish), and one beside it, reached the same ways, is not."""
    outputs = tmp_path / "outputs"
    (outputs / "hub_stage").mkdir(parents=True)
    (tmp_path / "link").symlink_to(outputs / "hub_stage", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    inside = [
        ("outputs/hub_stage/receipts", outputs / "hub_stage"),  # relative folder, absolute stage
        (outputs / "hub_stage" / "receipts", "outputs/hub_stage"),  # absolute folder, relative stage
        ("link/receipts", "outputs/hub_stage"),  # through a link to the stage
        ("outputs/../outputs/hub_stage", outputs / "hub_stage"),  # the stage itself, spelt round about
    ]
    for folder, stage in inside:
        with pytest.raises(PublishError, match=r"is inside the stage .*write receipts elsewhere"):
            check_receipt_dir(folder, Path(stage))
    for folder, stage in [("outputs/receipts", outputs / "hub_stage"), (outputs, "link")]:
        assert check_receipt_dir(folder, Path(stage)) == Path(folder)


def test_a_missing_receipt_folder_is_created_with_its_parents_and_a_file_in_its_place_is_refused(tmp_path):
    """Before any write request: a --receipt-dir two folders down that does not exist yet is
    made; one whose parent is a file cannot be, and is refused in one line."""
    prepare_receipt_dir(tmp_path / "runs" / "receipts")
    assert (tmp_path / "runs" / "receipts").is_dir()
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(PublishError) as refused:
        prepare_receipt_dir(tmp_path / "file" / "receipts")
    assert str(refused.value) == (
        f"--receipt-dir {tmp_path / 'file' / 'receipts'} cannot be created (Not a directory); nothing was published"
    )


# -- each staged file against the branch's ------------------------------------------------------


def test_each_staged_file_is_added_updated_repaired_or_left_by_what_the_branch_lists_at_its_path(tmp_path):
    data = {
        "new.bin": b"new",
        "longer.bin": b"four",
        "same-size.bin": b"abcd",
        "lfs.bin": b"lfs!",
        "xet-ok.bin": b"xet1",
        "xet-other.bin": b"xet2",
        "README.md": b"# card\n",
        "config.json": b"{}\n",
    }
    audited = {}
    for name, content in data.items():
        (tmp_path / name).write_bytes(content)
        xet_hash = {"xet-ok.bin": "1" * 64, "xet-other.bin": "2" * 64}.get(name)
        audited[name] = AuditedFile(
            name, len(content), hashlib.sha256(content).hexdigest(), "meta.json", xet_hash
        )

    def lfs(name, size=None, sha256=None, xet_hash=None):
        entry = audited[name]
        return RemoteFile(
            f"model/{name}", entry.size if size is None else size, "b" * 40, sha256 or entry.sha256, xet_hash
        )

    def blob(content):
        return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()

    remote = {
        "model/zz-old.txt": RemoteFile("model/zz-old.txt", 1, "c" * 40),
        "model/longer.bin": lfs("longer.bin", size=3, sha256="0" * 64),
        "model/same-size.bin": lfs("same-size.bin", sha256="f" * 64),  # same size, other bytes
        "model/lfs.bin": lfs("lfs.bin"),
        "model/xet-ok.bin": lfs("xet-ok.bin", xet_hash="1" * 64),
        "model/xet-other.bin": lfs("xet-other.bin", xet_hash="9" * 64),  # the declared SHA-256, other bytes
        "model/README.md": RemoteFile("model/README.md", 7, blob(b"# card\n")),
        "model/config.json": RemoteFile("model/config.json", 3, blob(b"[]\n")),
        "model/a-old.txt": RemoteFile("model/a-old.txt", 1, "d" * 40),
        ".gitattributes": RemoteFile(".gitattributes", 10, "e" * 40),  # the Hub's: kept
    }
    files, deletions = compare(tmp_path, audited, remote, "model/", StagedXetHashes(tmp_path, audited))
    actions = {
        "new.bin": "add",
        "longer.bin": "update",
        "same-size.bin": "update",
        "lfs.bin": "unchanged",
        "xet-ok.bin": "unchanged",
        "xet-other.bin": "repair",
        "README.md": "unchanged",
        "config.json": "update",
    }
    assert files == tuple(
        PlannedFile(name, f"model/{name}", audited[name].size, audited[name].sha256, action)
        for name, action in actions.items()
    )
    assert deletions == ("model/a-old.txt", "model/zz-old.txt")


def test_the_commit_title_and_description_name_step_0_as_a_step_and_no_step_as_the_model(tmp_path):
    weights = AuditedFile(name="modelo.safetensors", size=4, sha256="a" * 64, verified_against="meta.json")
    audited = {weights.name: weights}
    table = f"{'a' * 64}             4  modelo.safetensors\n"
    for recorded, what in ((0, "step 0"), (None, "the model")):
        (tmp_path / "meta.json").write_text(json.dumps({"step": recorded}))
        assert _messages(tmp_path, audited, None) == (
            recorded,
            "a" * 64,
            f"Publish {what}: modelo.safetensors sha256 {'a' * 64}",
            f"{what.capitalize()}. modelo.safetensors SHA-256 {'a' * 64}.\n\n"
            f"Staged files (SHA-256, bytes, name):\n{table}",
        )


# -- the plan as 06 prints it ---------------------------------------------------------------------


def planned(head, repo_exists, files, deletions=(), revision="main"):
    return PublishPlan(
        endpoint="https://hub.example",
        repo_id="alice/m",
        revision=revision,
        path_in_repo="model",
        repo_exists=repo_exists,
        head=head,
        step=7,
        model_sha256="a" * 64,
        title="Publish step 7: model.safetensors sha256 " + "a" * 64,
        description="",
        files=files,
        deletions=deletions,
    )


def test_the_printed_plan_names_the_target_the_parent_each_file_and_each_deletion_aligned():
    files = (
        PlannedFile("model.safetensors", "model/model.safetensors", 123456, "a" * 64, "update"),
        PlannedFile("README.md", "model/README.md", 99, "b" * 64, "repair"),
        PlannedFile("meta.json", "model/meta.json", 5, "c" * 64, "unchanged"),
    )
    text = format_plan(planned("c0ffee", True, files, ("model/old.bin",)))
    assert text.splitlines() == [
        "target  https://hub.example/alice/m (branch main at c0ffee)",
        "commit  Publish step 7: model.safetensors sha256 " + "a" * 64,
        "  update     model/model.safetensors      123456 B  sha256 " + "a" * 64,
        "  repair     model/README.md                  99 B  sha256 " + "b" * 64,
        "  unchanged  model/meta.json                   5 B  sha256 " + "c" * 64,
        "  delete     model/old.bin",
    ]
    new_branch = format_plan(planned(None, True, files, revision="dev")).splitlines()[0]
    assert new_branch == "target  https://hub.example/alice/m (new branch dev, would be created from main)"
    new_repo = format_plan(planned(None, False, files)).splitlines()[0]
    assert new_repo == "target  https://hub.example/alice/m (new repo, would be created; branch main)"


def test_the_printed_plan_of_a_branch_holding_exactly_the_stage_ends_saying_there_is_nothing_to_publish():
    unchanged = (PlannedFile("meta.json", "model/meta.json", 5, "c" * 64, "unchanged"),)
    assert format_plan(planned("c0ffee", True, unchanged)).splitlines()[-1] == (
        "nothing to publish: alice/m@main already holds exactly this stage"
    )
    changed = (*unchanged, PlannedFile("README.md", "model/README.md", 9, "d" * 64, "update"))
    not_yet = (
        planned(None, True, unchanged),  # a new branch: its creation is the commit
        planned("c0ffee", True, unchanged, ("model/old.bin",)),
        planned("c0ffee", True, changed),
    )
    for plan in not_yet:
        assert "nothing to publish" not in format_plan(plan)


def test_a_dry_run_to_a_new_branch_plans_it_from_main_and_names_the_step_and_weights(
    staged_run, hub, tmp_path, token_env
):
    api = api_for(hub)
    api.create_repo("alice/branched")
    api.upload_file(path_or_fileobj=b"notes", path_in_repo="notes.txt", repo_id="alice/branched")
    writes = write_requests(hub)
    result = publish_here(staged_run.stage, hub, "alice/branched", tmp_path, dry_run=True, revision="dev")
    plan = result.plan
    assert (plan.repo_exists, plan.head, plan.revision) == (True, None, "dev")
    assert plan.deletions == ("notes.txt",)  # compared with main, where the branch would start
    assert {f.action for f in plan.files} == {"add"}
    assert format_plan(plan).splitlines()[0] == (
        f"target  {hub.url}/alice/branched (new branch dev, would be created from main)"
    )
    weights = next(f for f in plan.files if f.name.endswith(".safetensors"))
    assert plan.model_sha256 == weights.sha256
    assert plan.title == f"Publish step {plan.step}: {weights.name} sha256 {weights.sha256}"
    table = "".join(f"{f.sha256}  {f.size:>12}  {f.name}\n" for f in plan.files)
    assert plan.description == (
        f"Step {plan.step}. {weights.name} SHA-256 {weights.sha256}.\n\nStaged files (SHA-256, bytes, name):\n{table}"
    )
    assert write_requests(hub) == writes


def test_a_dry_run_to_a_folder_plans_against_that_folder_alone(staged_run, hub, tmp_path, token_env):
    """Files outside --path-in-repo are neither compared nor planned for deletion."""
    api = api_for(hub)
    api.create_repo("alice/foldered")
    api.upload_file(path_or_fileobj=b"notes", path_in_repo="notes.txt", repo_id="alice/foldered")
    result = publish_here(
        staged_run.stage,
        hub,
        "alice/foldered",
        tmp_path,
        dry_run=True,
        path_in_repo="model",
        message="Add model/",
    )
    plan = result.plan
    assert (plan.path_in_repo, plan.deletions) == ("model", ())
    assert format_plan(plan).splitlines()[1] == "commit  Add model/"  # 06 --message: the title
    assert [(f.path_in_repo, f.action) for f in plan.files] == [
        (f"model/{f.name}", "add") for f in plan.files
    ]


# -- a Xet-stored file after landing ------------------------------------------------------------


def test_a_xet_stored_file_lands_only_with_the_audits_xet_hash_sha256_and_size():
    audited = "a" * 64
    expected = AuditedFile(name="w.safetensors", size=4, sha256=audited, verified_against="meta.json")

    def listed(**changes):
        fields = {
            "path": "w.safetensors",
            "size": 4,
            "blob_id": "b" * 40,
            "sha256": audited,
            "xet_hash": "c" * 64,
        }
        return RemoteFile(**{**fields, **changes})

    def check(remote):
        result = check_landed("w.safetensors", expected, remote, "c" * 64, lambda: pytest.fail("downloaded"))
        return result.found, result.checked_by, result.problem

    assert check(listed()) == (audited, "Hub Xet hash", None)
    assert check(listed(xet_hash="d" * 64)) == (
        None,
        "Hub Xet hash",
        f"w.safetensors: the Hub lists Xet hash {'d' * 64}, the audited bytes hash to {'c' * 64}",
    )
    assert check(listed(sha256="e" * 64)) == (
        None,
        "Hub Xet hash",
        f"w.safetensors: the Hub lists SHA-256 {'e' * 64} and 4 bytes, the audit {audited} and 4",
    )
    assert check(listed(size=5)) == (
        None,
        "Hub Xet hash",
        f"w.safetensors: the Hub lists SHA-256 {audited} and 5 bytes, the audit {audited} and 4",
    )


def test_a_xet_hash_of_bytes_hf_xet_stopped_reading_midway_is_no_hash(monkeypatch, tmp_path):
    """The audit feeds hf_xet through a pipe; if hf_xet stops reading before the end (and still
    answers a hash, of what it read), that hash is of other bytes than the file's: the digest says
    it has none, and the file is then verified by its bytes, never by that hash."""
    import hf_xet

    from pipeline.publishing.xet import XetDigest

    class Info:
        hash = "f" * 64  # what a reader that stopped early would answer

    def hash_files_stopping_early(paths):
        with open(paths[0], "rb") as pipe:
            pipe.read(10)
        return [Info()]

    data = b"x" * (3 << 20)
    (tmp_path / "bytes").write_bytes(data)
    whole = XetDigest()
    whole.update(data)
    assert whole.hexdigest() == hf_xet.hash_files([str(tmp_path / "bytes")])[0].hash

    monkeypatch.setattr(hf_xet, "hash_files", hash_files_stopping_early)
    stopped = XetDigest()
    stopped.update(data)  # more than the pipe holds: the write fails once the reader left
    assert stopped.hexdigest() is None
