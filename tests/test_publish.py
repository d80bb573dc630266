"""Publishing the stage (scripts/06_publish.py, pipeline.publishing) against a real loopback Hub.

Every request goes through the real huggingface_hub client to ``localhub`` over
HTTP, on the legacy LFS path (``HF_HUB_DISABLE_XET=1``) unless a test asks for Xet (the
``published`` runs are made once per protocol; the ``xet`` fixture switches this process).
The stage is the one the real scripts build (``staged_run`` in conftest.py). The script runs
as a subprocess where its exit code, output and files matter; the fault cases call
:func:`pipeline.publishing.publish` in this process so that only sleeps are shortened.
The test token is random per session, so it can appear in no file by accident.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx2
import pytest
import torch
from huggingface_hub import CommitOperationAdd, HfApi, constants, snapshot_download
from huggingface_hub import lfs as hf_lfs
from huggingface_hub.errors import RepositoryNotFoundError
from huggingface_hub.utils import _http as hf_http
from huggingface_hub.utils import disable_progress_bars, enable_progress_bars, hf_raise_for_status
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from localhub import LocalHub, LocalHubProcess
from pipeline.audit import AuditedFile, parse_manifest
from pipeline.checkpoint import load_model_weights, read_tensors
from pipeline.config import load_config
from pipeline.data import load_task_data
from pipeline.errors import (
    HubUnavailable,
    PublishError,
    PublishTimedOut,
    StageChanged,
    StaleBranch,
    TokenRejected,
    UploadInterrupted,
    VerificationFailed,
)
from pipeline.evaluate import evaluation_config
from pipeline.publishing import COMMIT_ATTEMPTS, Publication, format_plan, publish
from pipeline.publishing.client import RemoteFile
from pipeline.publishing.deadline import Deadline
from pipeline.publishing.xet import XetDigest, check_landed
from pipeline.rng import seed_everything
from pipeline.run import build_model

from support import TREE_PATH, run_python

# The client's LFS PUT passes a file object as `data=`, which httpx2 flags; nothing to fix on our side.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "06_publish.py"
CONFIG = REPO_ROOT / "config.yaml"
TOKEN = f"pub-test-{secrets.token_hex(16)}"
WRONG_TOKEN = f"pub-wrong-{secrets.token_hex(16)}"
SECRETS = (TOKEN, WRONG_TOKEN)
STAGED = (
    "MANIFEST.sha256",
    "README.md",
    "meta.json",
    "modelo.safetensors",
    "training_curve.png",
    "config.json",
    "model.safetensors.index.json",
    "runs/events.out.tfevents.pipeline",
)


def stage_files(stage: Path) -> set[str]:
    """Every file of a stage (the top-level ones above plus the model's code under code/)."""
    return {p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file()}


_SCRUBBED = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "LOCALHUB_TOKEN")


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def hf_env(tmp_path, monkeypatch):
    """The client in this process: LFS path, no telemetry, a private HF_HOME, no implicit token."""
    hf_home = tmp_path / "hf_home"
    for key, value in {
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": str(hf_home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }.items():
        monkeypatch.setenv(key, value)
    for key in _SCRUBBED:
        monkeypatch.delenv(key, raising=False)
    for name, value in {
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens"),
    }.items():
        monkeypatch.setattr(constants, name, value)
    # In this process the upload bars only clutter the test output (the script keeps its own).
    disable_progress_bars()
    yield
    enable_progress_bars()


@pytest.fixture(autouse=True)
def waits(monkeypatch) -> list[float]:
    """publish()'s own retry waits in this process, recorded instead of slept (the clock stays real)."""
    recorded: list[float] = []
    monkeypatch.setattr(Deadline, "sleep", staticmethod(recorded.append))
    return recorded


def use_protocol(monkeypatch, protocol: str) -> None:
    """Switch the client in this process to ``protocol`` ("lfs" or "xet") for one test."""
    if protocol == "xet":
        monkeypatch.delenv("HF_HUB_DISABLE_XET", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", protocol != "xet")


@pytest.fixture
def xet(monkeypatch):
    """The client in this process uploads and downloads through Xet, as it does by default."""
    use_protocol(monkeypatch, "xet")


@pytest.fixture
def hub(tmp_path):
    with LocalHub(tmp_path / "hub", token=TOKEN) as server:
        yield server


@pytest.fixture
def token_env(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)


@pytest.fixture
def no_client_sleep(monkeypatch):
    """Only the client's own backoff clock (1..8 s between its retries) is replaced; HTTP stays real."""
    monkeypatch.setattr(hf_http, "time", SimpleNamespace(sleep=lambda seconds: None))


@pytest.fixture(scope="module")
def module_hub(tmp_path_factory):
    with LocalHub(tmp_path_factory.mktemp("module_hub"), token=TOKEN) as server:
        yield server


# The tests that read the published repos go to one xdist worker, so each is published once.
PUBLISHED = pytest.mark.xdist_group("published")


@pytest.fixture(scope="module", params=["lfs", "xet"])
def published(request, staged_run, module_hub, tmp_path_factory):
    """06 run twice against a fresh repo over one protocol: ``first`` publishes, ``rerun`` must
    find nothing to do."""
    protocol = request.param
    receipts = tmp_path_factory.mktemp(f"receipts-{protocol}")
    repo_id = f"alice/published-{protocol}"
    module_hub.reset_request_counts()
    first = run_publish(staged_run.stage, module_hub, repo_id, receipts, protocol=protocol)
    first_requests = module_hub.request_counts()
    module_hub.reset_request_counts()
    rerun = run_publish(staged_run.stage, module_hub, repo_id, receipts, protocol=protocol)
    return SimpleNamespace(
        first=first,
        rerun=rerun,
        first_requests=first_requests,
        rerun_requests=module_hub.request_counts(),
        repo_id=repo_id,
        receipts=receipts,
        hub=module_hub,
        run=staged_run,
        protocol=protocol,
    )


# -- helpers -----------------------------------------------------------------------------


def run_publish(
    stage: Path,
    hub: LocalHub,
    repo_id: str,
    receipts: Path,
    *args: str,
    token: str | None = TOKEN,
    protocol: str = "lfs",
    timeout: float = 300,
    env: dict[str, str | None] | None = None,
) -> subprocess.CompletedProcess:
    """scripts/06_publish.py as a subprocess; fails the test if any secret shows in its output.
    ``env`` sets variables (None removes one)."""
    base = {k: v for k, v in os.environ.items() if k not in _SCRUBBED + ("HF_HUB_DISABLE_XET",)}
    base.update(
        {
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": TREE_PATH,
            "HF_HOME": str(receipts.parent / "hf_home_script"),
        }
    )
    if protocol == "lfs":
        base["HF_HUB_DISABLE_XET"] = "1"
    if token is not None:
        base["HF_TOKEN"] = token
    for name, value in (env or {}).items():
        if value is None:
            base.pop(name, None)
        else:
            base[name] = value
    env = base
    result = run_python(
        [
            SCRIPT,
            "--repo-id",
            repo_id,
            "--endpoint",
            hub.url,
            "--stage",
            stage,
            "--receipt-dir",
            receipts,
            *args,
        ],
        cwd=stage.parent,
        env=env,
        timeout=timeout,
    )
    for secret in SECRETS:
        assert secret not in result.stdout + result.stderr, "a token was printed"
    return result


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def api_for(hub: LocalHub) -> HfApi:
    return HfApi(endpoint=hub.url, token=TOKEN)


def commit_titles(hub: LocalHub, repo_id: str) -> list[str]:
    return [c.title for c in api_for(hub).list_repo_commits(repo_id)]


def write_requests(hub: LocalHub) -> int:
    return sum(hub.count(method) for method in ("POST", "PUT", "DELETE"))


def publish_here(stage: Path, hub: LocalHub, repo_id: str, tmp_path: Path, *, say=None, **fields):
    """publish() in this process (its retry waits are recorded by the ``waits`` fixture)."""
    publication = Publication(
        repo_id=repo_id, stage=stage, endpoint=hub.url, receipt_dir=tmp_path / "receipts", **fields
    )
    return publish(publication, say=say or (lambda line: None))


def assert_holds_exactly_the_stage(
    hub: LocalHub, repo_id: str, stage: Path, prefix: str = "", revision: str | None = None
) -> None:
    api = api_for(hub)
    listed = {
        f.path: f
        for f in api.list_repo_tree(repo_id, prefix or None, recursive=True, revision=revision)
        if hasattr(f, "blob_id")
    }
    assert set(STAGED) <= stage_files(stage)
    assert set(listed) - {".gitattributes"} == {prefix + name for name in stage_files(stage)}
    manifest = parse_manifest((stage / "MANIFEST.sha256").read_bytes())
    for name, sha in manifest.items():
        entry = listed[prefix + name]
        if entry.lfs is not None:
            assert entry.lfs.sha256 == sha
        else:
            data = (stage / name).read_bytes()
            assert entry.blob_id == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# -- publishing and rerunning (subprocess) -----------------------------------------------


@PUBLISHED
def test_first_publish_creates_exactly_one_commit_holding_the_whole_stage(published):
    hub, stage = published.hub, published.run.stage
    assert published.first.returncode == 0, published.first.stdout + published.first.stderr
    titles = commit_titles(hub, published.repo_id)
    assert len(titles) == 2 and titles[1] == "initial commit"
    sha = json.loads((stage / "meta.json").read_text())["files"]["modelo.safetensors"]["sha256"]
    assert titles[0] == f"Publish step 10: modelo.safetensors sha256 {sha}"
    [description] = [c.message for c in api_for(hub).list_repo_commits(published.repo_id)][:1]
    table = {name: hashlib.sha256((stage / name).read_bytes()).hexdigest() for name in stage_files(stage)}
    assert description.startswith(
        f"Step 10. modelo.safetensors SHA-256 {sha}.\n\nStaged files (SHA-256, bytes, name):\n"
    ), description
    rows = [line.split("  ") for line in description.splitlines()[3:]]
    assert {row[-1]: row[0] for row in rows} == table and len(rows) == len(table), description
    assert_holds_exactly_the_stage(hub, published.repo_id, stage)
    head = api_for(hub).repo_info(published.repo_id).sha
    assert published.first.stdout.splitlines()[-1] == f"commit {hub.url}/{published.repo_id}/commit/{head}"
    # Not a terminal: the client's upload bars stay off, so no cursor escape code lands in a log.
    assert "\x1b" not in published.first.stdout + published.first.stderr


@PUBLISHED
def test_the_hub_clients_progress_bars_stay_off_when_stderr_is_not_a_terminal(published):
    for result in (published.first, published.rerun):
        assert result.returncode == 0 and "%|" not in result.stderr, result.stderr


@PUBLISHED
def test_published_weights_have_the_checkpoint_sha256_on_the_hub(published):
    [entry] = api_for(published.hub).get_paths_info(published.repo_id, ["modelo.safetensors"], expand=True)
    checkpoint_meta = json.loads((published.run.checkpoint / "meta.json").read_text())
    assert (
        entry.lfs is not None and entry.lfs.sha256 == checkpoint_meta["files"]["modelo.safetensors"]["sha256"]
    )
    if published.protocol == "xet":  # stored in the CAS: the Hub names its Xet file hash too
        assert entry.xet_hash is not None and len(entry.xet_hash) == 64 and int(entry.xet_hash, 16) >= 0
        assert published.hub.store.xet.file(entry.xet_hash)["size"] == entry.size
    else:
        assert entry.xet_hash is None


@PUBLISHED
def test_publish_writes_a_receipt_outside_the_stage_with_commit_and_hashes(published):
    head = api_for(published.hub).repo_info(published.repo_id).sha
    [receipt] = list(published.receipts.glob("*.json"))
    record = json.loads(receipt.read_text())
    assert receipt.name == f"{published.repo_id.replace('/', '--')}-{head[:12]}.json"
    assert (record["repo_id"], record["commit"], record["status"], record["verified"]) == (
        published.repo_id,
        head,
        "published",
        True,
    )
    assert record["commit_url"] == f"{published.hub.url}/{published.repo_id}/commit/{head}"
    # The publish's own receipt, kept by the rerun: made on top of the repo's first commit, at the root of main.
    initial = api_for(published.hub).list_repo_commits(published.repo_id)[-1].commit_id
    assert {
        key: record[key] for key in ("endpoint", "revision", "path_in_repo", "parent_commit", "step")
    } == {
        "endpoint": published.hub.url,
        "revision": "main",
        "path_in_repo": "",
        "parent_commit": initial,
        "step": 10,
    }
    assert (record["signature"], record["problems"]) == (None, [])
    manifest = parse_manifest((published.run.stage / "MANIFEST.sha256").read_bytes())
    assert {name: record["files"][name]["found"] for name in manifest} == manifest
    # Over Xet the listed SHA-256 is the client's claim: the weights were checked by the Xet hash the
    # Hub derived from the chunks it verified, against the one the audit computed from the audited bytes.
    weights = record["files"]["modelo.safetensors"]
    expected_check = {"lfs": ("lfs", "Hub LFS SHA-256"), "xet": ("xet", "Hub Xet hash")}
    assert (weights["storage"], weights["checked_by"]) == expected_check[published.protocol]
    assert (weights["xet_hash"] is not None) == (published.protocol == "xet")
    # Verified without reading the weights back: no download, no Xet reconstruction or xorb read.
    reads = [
        key
        for key in published.first_requests
        if key.startswith("GET") and re.search(r"modelo\.safetensors$|/reconstructions/|/_xet/data/", key)
    ]
    assert reads == [], reads
    assert not any(p.suffix == ".json" and "receipt" in p.name for p in published.run.stage.iterdir())


@PUBLISHED
def test_rerun_makes_no_commit_and_says_already_published(published):
    assert published.rerun.returncode == 0, published.rerun.stderr
    head = api_for(published.hub).repo_info(published.repo_id).sha
    assert (
        f"nothing to publish: {published.repo_id} already holds this stage at {head}"
        in published.rerun.stdout
    )
    assert len(commit_titles(published.hub, published.repo_id)) == 2
    assert not any(key.startswith(("POST", "PUT", "DELETE")) for key in published.rerun_requests), (
        published.rerun_requests
    )


@PUBLISHED
def test_the_one_commit_holds_the_tensorboard_traces_where_the_hub_finds_them(published, tmp_path):
    api = api_for(published.hub)
    first = api.list_repo_commits(published.repo_id)[0].commit_id
    name = "runs/events.out.tfevents.pipeline"
    assert name in api.list_repo_files(published.repo_id, revision=first)
    path = api.hf_hub_download(published.repo_id, name, revision=first, local_dir=tmp_path)
    assert Path(path).read_bytes() == (published.run.stage / name).read_bytes()
    traces = EventAccumulator(str(Path(path).parent), size_guidance={"scalars": 0})
    traces.Reload()
    assert [e.step for e in traces.Scalars("train/loss")] == list(range(1, 11))


@PUBLISHED
def test_an_identical_run_staged_elsewhere_publishes_nothing_new(published, restaged_run, tmp_path):
    """The same config trained, evaluated and staged again, in another folder at another time:
    the same stage, so 06 finds the repo already holding it and sends no write."""
    published.hub.reset_request_counts()
    result = run_publish(
        restaged_run.stage, published.hub, published.repo_id, tmp_path, protocol=published.protocol
    )
    assert result.returncode == 0, result.stdout + result.stderr
    head = api_for(published.hub).repo_info(published.repo_id).sha
    assert f"nothing to publish: {published.repo_id} already holds this stage at {head}" in result.stdout
    assert len(commit_titles(published.hub, published.repo_id)) == 2
    assert not any(key.startswith(("POST", "PUT", "DELETE")) for key in published.hub.request_counts())


@PUBLISHED
def test_published_repo_reproduces_the_staged_metric_in_a_fresh_model(published, tmp_path, monkeypatch):
    use_protocol(monkeypatch, published.protocol)
    rebuilt = published.hub.count("GET", r"/reconstructions/")
    folder = Path(
        snapshot_download(
            published.repo_id, endpoint=published.hub.url, token=TOKEN, cache_dir=tmp_path / "cache"
        )
    )
    manifest = parse_manifest((published.run.stage / "MANIFEST.sha256").read_bytes())
    assert {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in manifest} == manifest
    # Over Xet the weights came back through the CAS reconstruction API, not a plain GET.
    assert (published.hub.count("GET", r"/reconstructions/") > rebuilt) == (published.protocol == "xet")
    meta = json.loads((folder / "meta.json").read_text())
    here = load_config(CONFIG, {"data.dir": str(published.run.data_dir), "training.device": "cpu"})
    config = evaluation_config(meta, here, source="published meta.json")
    seed_everything(config.training.seed)  # as scripts/04_evaluate.py does before building
    model = build_model(config, "cpu")
    load_model_weights(model, read_tensors(folder / "modelo.safetensors"))  # strict
    model.eval()
    with torch.no_grad():
        metrics = load_task_data(config).evaluate(model, torch.device("cpu"))
    assert metrics == meta["metrics"]["values"]


# -- refusals (subprocess) -----------------------------------------------------------------


def test_tampered_stage_is_refused_before_any_request(staged_run, run_copy, hub, tmp_path):
    run = run_copy(staged_run)
    card = run.stage / "README.md"
    data = bytearray(card.read_bytes())
    data[-2] ^= 0x01  # same size, one bit differs
    card.write_bytes(bytes(data))
    line = one_error_line(run_publish(run.stage, hub, "alice/tampered", tmp_path / "receipts"))
    assert "README.md" in line and "MANIFEST.sha256" in line
    assert hub.request_counts() == {}
    assert not (tmp_path / "receipts").exists()


def test_wrong_token_is_a_clear_error_and_creates_nothing(staged_run, hub, tmp_path):
    result = run_publish(staged_run.stage, hub, "alice/wrong", tmp_path / "receipts", token=WRONG_TOKEN)
    line = one_error_line(result)
    assert "token rejected or no write access to alice/wrong" in line and "HF_TOKEN" in line
    assert hub.count("POST", r"/commit/") == 0 and hub.count("PUT") == 0
    with pytest.raises(RepositoryNotFoundError):
        api_for(hub).repo_info("alice/wrong")


def test_token_is_not_accepted_on_the_command_line(staged_run, hub, tmp_path):
    result = run_publish(staged_run.stage, hub, "alice/flag", tmp_path / "receipts", "--token", WRONG_TOKEN)
    line = one_error_line(result)  # run_publish also checked that the value was not echoed
    assert "--token is not accepted" in line and "HF_TOKEN" in line
    assert hub.request_counts() == {}


@PUBLISHED
def test_token_appears_in_no_file_of_the_repo_receipts_or_hub_state(published, tmp_path):
    assert published.first.returncode == 0 and published.rerun.returncode == 0
    roots = [REPO_ROOT, published.receipts, published.hub.root, published.run.root]
    needle = TOKEN.encode()
    leaks = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in (".venv", ".git")]
            for name in filenames:
                path = Path(dirpath, name)
                if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
                    leaks.append(path)
    assert leaks == []
    assert published.receipts.exists() and any(published.receipts.iterdir())  # the scan saw the receipt


# -- faults (in process: the same code, sleeps recorded instead of slept) ------------------


def test_a_commit_the_hub_asks_to_retry_later_every_time_gives_up_after_the_last_attempt(
    staged_run, hub, tmp_path, token_env, waits
):
    """A Retry-After on each of the four answers, every wait within the --timeout: the line
    says the Hub answered four times, not that it asks for a wait (it asked for none past the
    --timeout)."""
    hub.rate_limit_next(times=COMMIT_ATTEMPTS, retry_after=3, method="POST", path=r"/commit/main$")
    with pytest.raises(HubUnavailable) as refused:
        publish_here(staged_run.stage, hub, "alice/throttled", tmp_path)
    assert str(refused.value) == (
        "the Hub answered HTTP 429 to the commit on alice/throttled 4 times; nothing was committed; "
        "rerun later (uploaded blobs are kept)"
    )
    assert waits == [3.0, 3.0, 3.0] and commit_titles(hub, "alice/throttled") == ["initial commit"]


def test_commit_failing_with_500_leaves_no_commit_and_a_rerun_lands_exactly_one(
    staged_run, hub, tmp_path, token_env, waits
):
    hub.fail_next_commit(times=COMMIT_ATTEMPTS, status=500)
    said: list[str] = []
    with pytest.raises(HubUnavailable) as refused:
        publish_here(staged_run.stage, hub, "alice/flaky", tmp_path, say=said.append)
    assert refused.value.exit_code == 2
    assert str(refused.value) == (
        "the Hub answered HTTP 500 to the commit on alice/flaky 4 times; nothing was committed; "
        "rerun later (uploaded blobs are kept)"
    )
    assert waits == [1.0, 2.0, 4.0]  # no Retry-After: 1, 2, 4 s between the four attempts
    assert [line for line in said if "retrying" in line] == [
        f"the commit got HTTP 500; retrying the commit in {wait}s (attempt {attempt} of 4)"
        for wait, attempt in ((1, 2), (2, 3), (4, 4))
    ]
    assert commit_titles(hub, "alice/flaky") == ["initial commit"]
    assert api_for(hub).list_repo_files("alice/flaky") == [".gitattributes"]

    result = publish_here(staged_run.stage, hub, "alice/flaky", tmp_path)
    assert result.status == "published" and len(commit_titles(hub, "alice/flaky")) == 2
    assert_holds_exactly_the_stage(hub, "alice/flaky", staged_run.stage)


@pytest.mark.parametrize("status", [502, 503, 504])
def test_one_500_on_the_commit_is_retried_and_lands_once(staged_run, hub, tmp_path, token_env, waits, status):
    hub.fail_next_commit(times=1, status=status)
    unmade = tmp_path / "not" / "made"  # the receipt folder is created with its parents
    result = publish_here(staged_run.stage, hub, "alice/retried", unmade)
    assert result.status == "published" and waits == [1.0] and not result.answer_lost
    assert hub.count("POST", r"/commit/main$") == 2
    assert len(commit_titles(hub, "alice/retried")) == 2
    assert len(list((unmade / "receipts").glob("alice--retried-*.json"))) == 1


def test_a_commit_refused_with_a_4xx_is_not_retried_and_is_one_line(
    staged_run, hub, tmp_path, token_env, waits
):
    hub.fail_next_commit(times=1, status=422)
    with pytest.raises(PublishError) as refused:
        publish_here(staged_run.stage, hub, "alice/refused", tmp_path)
    assert type(refused.value) is PublishError and str(refused.value).startswith(
        "the Hub answered HTTP 422 while uploading and committing on alice/refused: "
    ), refused.value
    assert str(refused.value).endswith("; nothing was committed") and "\n" not in str(refused.value)
    assert waits == [] and hub.count("POST", r"/commit/main$") == 1
    assert commit_titles(hub, "alice/refused") == ["initial commit"]


@pytest.mark.parametrize("earlier_500s", [0, COMMIT_ATTEMPTS - 1], ids=["first-attempt", "last-attempt"])
def test_commit_that_landed_but_answered_500_is_not_made_twice(
    staged_run, hub, tmp_path, token_env, monkeypatch, waits, earlier_500s
):
    hub.fail_next_commit(times=earlier_500s, status=500)  # answered 500 without landing
    real_create_commit = HfApi.create_commit

    def lands_then_answers_500(self, *args, **kwargs):
        real_create_commit(self, *args, **kwargs)
        # The commit is written, but the answer the client gets is a real HTTP 500 from the server.
        hub.fail_next_commit(times=1, status=500)
        hf_raise_for_status(
            httpx2.post(
                f"{hub.url}/api/models/alice/lost-answer/commit/main",
                headers={"Authorization": f"Bearer {TOKEN}"},
                content=b"",
            )
        )

    monkeypatch.setattr(HfApi, "create_commit", lands_then_answers_500)
    said: list[str] = []
    result = publish_here(staged_run.stage, hub, "alice/lost-answer", tmp_path, say=said.append)
    assert result.status == "published" and result.commit == api_for(hub).repo_info("alice/lost-answer").sha
    assert result.answer_lost  # 06 says the commit was found on the branch
    assert len(commit_titles(hub, "alice/lost-answer")) == 2
    assert [line for line in said if "landed" in line] == [
        f"the commit had landed despite the error answer: {result.commit}"
    ], said
    assert waits == [1.0, 2.0, 4.0][: max(1, earlier_500s)]  # the last attempt's answer: no wait after it


def test_a_push_holding_the_stage_and_more_during_the_commits_retry_is_not_taken_for_our_commit(
    staged_run, hub, tmp_path, token_env, monkeypatch
):
    """The commit is answered 500 without landing; while 06 waits to retry, someone pushes the
    staged files plus one more. That head is not our commit landed despite the error: the retry
    finds nothing to change (the client returns the head) and the check after landing refuses it."""
    hub.fail_next_commit(times=1, status=500)
    api = api_for(hub)
    stage = staged_run.stage
    pushed: list[str] = []

    def someone_pushes(seconds: float) -> None:
        if not pushed:
            ops = [CommitOperationAdd(name, str(stage / name)) for name in sorted(stage_files(stage))]
            info = api.create_commit(
                "alice/pushed", ops + [CommitOperationAdd("notes.txt", b"more\n")], commit_message="a push"
            )
            pushed.append(info.oid)

    monkeypatch.setattr(Deadline, "sleep", staticmethod(someone_pushes))
    said: list[str] = []
    with pytest.raises(VerificationFailed) as refused:
        publish_here(stage, hub, "alice/pushed", tmp_path, say=said.append)
    [receipt] = (tmp_path / "receipts").glob("*.json")
    assert str(refused.value) == (
        f"commit {hub.url}/alice/pushed/commit/{pushed[0]} landed but differs from the audited stage: "
        f"notes.txt is in the commit but not in the stage; receipt {receipt}"
    )
    assert [line for line in said if "landed" in line] == [], said
    assert commit_titles(hub, "alice/pushed") == ["a push", "initial commit"]


def test_a_lost_commit_answer_and_a_head_holding_the_stage_and_a_file_no_longer_staged_is_not_our_commit(
    staged_run, hub, tmp_path, token_env, monkeypatch, waits
):
    """The repository holds a file the stage no longer has, so our commit deletes it. Its
    connection breaks after someone pushed the staged files and kept that file: the moved head
    holds every staged file unchanged, yet it is not our commit (which would have deleted it)."""
    api = api_for(hub)
    api.create_repo("alice/kept")
    api.upload_file(
        repo_id="alice/kept", path_or_fileobj=b"old\n", path_in_repo="old.txt", commit_message="old"
    )
    stage = staged_run.stage
    real_create_commit = HfApi.create_commit

    def pushed_then_connection_lost(self, repo_id, *args, **kwargs):
        ops = [CommitOperationAdd(name, str(stage / name)) for name in sorted(stage_files(stage))]
        real_create_commit(api, "alice/kept", ops, commit_message="a push")
        raise httpx2.ConnectError("connection reset by peer")

    monkeypatch.setattr(HfApi, "create_commit", pushed_then_connection_lost)
    said: list[str] = []
    with pytest.raises(UploadInterrupted) as interrupted:
        publish_here(stage, hub, "alice/kept", tmp_path, say=said.append)
    assert str(interrupted.value) == (
        f"connection to {hub.url} lost (ConnectError: connection reset by peer) while uploading and committing, "
        f"and the head of main moved to {api.repo_info('alice/kept').sha}, which is not this stage (someone else "
        "pushed): nothing was committed; rerun: it skips blobs already uploaded and never makes a second commit"
    )
    assert [line for line in said if "landed" in line] == [
        f"connection to {hub.url} lost (ConnectError: connection reset by peer) while uploading and committing; "
        "reading the branch head to see whether the commit landed"
    ], said


# A head id a hostile Hub could answer: a line break, a carriage return and a terminal escape
# that would forge a second line, and how the refusal shows it.
HOSTILE_HEAD = "f00d\r\x1b[2Kerror: the commit landed\u2028\nok"
HOSTILE_HEAD_SHOWN = "f00d\\x0d\\x1b[2Kerror: the commit landed\\u2028\\x0aok"


@pytest.mark.parametrize("hub_shows", ["unmoved", "moved", "deleted", "moved-to-a-hostile-id"])
def test_a_lost_commit_answer_on_a_branch_says_what_its_head_shows_in_one_line(
    staged_run, hub, tmp_path, token_env, monkeypatch, waits, hub_shows
):
    """The commit to ``dev`` loses its connection: the refusal names dev and says what its head
    shows: not moved, moved to another's commit (named, inert when the Hub's id is not plain
    text), or the branch deleted since the plan read it."""
    api = api_for(hub)
    pushed: list[str] = []
    real_create_commit = HfApi.create_commit

    def connection_lost(self, repo_id, *args, **kwargs):
        if hub_shows.startswith("moved"):
            notes = [CommitOperationAdd("notes.txt", b"more\n")]
            pushed.append(
                real_create_commit(api, repo_id, notes, commit_message="a push", revision="dev").oid
            )
        elif hub_shows == "deleted":
            api.delete_branch(repo_id, branch="dev")
        raise httpx2.ConnectError("connection reset by peer")

    real_repo_info, real_tree = HfApi.repo_info, HfApi.list_repo_tree

    def hostile_head(self, repo_id, *args, **kwargs):
        info = real_repo_info(self, repo_id, *args, **kwargs)
        if pushed and hub_shows == "moved-to-a-hostile-id":
            info.sha = HOSTILE_HEAD
        return info

    def tree(self, repo_id, path_in_repo=None, *, revision=None, **kwargs):
        revision = pushed[0] if revision == HOSTILE_HEAD else revision
        return real_tree(self, repo_id, path_in_repo, revision=revision, **kwargs)

    monkeypatch.setattr(HfApi, "create_commit", connection_lost)
    monkeypatch.setattr(HfApi, "repo_info", hostile_head)
    monkeypatch.setattr(HfApi, "list_repo_tree", tree)
    with pytest.raises(UploadInterrupted) as interrupted:
        publish_here(staged_run.stage, hub, "alice/lost-dev", tmp_path, revision="dev")
    shows = {
        "unmoved": "the head of dev did not move",
        "moved": f"the head of dev moved to {pushed[0] if pushed else ''}, which is not this stage (someone else pushed)",
        "deleted": "branch dev no longer exists",
        "moved-to-a-hostile-id": (
            f"the head of dev moved to {HOSTILE_HEAD_SHOWN}, which is not this stage (someone else pushed)"
        ),
    }[hub_shows]
    assert str(interrupted.value) == (
        f"connection to {hub.url} lost (ConnectError: connection reset by peer) while uploading and committing, "
        f"and {shows}: nothing was committed; rerun: it skips blobs already uploaded and never makes a second commit"
    )


def test_a_publish_to_another_branch_creates_it_from_main_and_commits_there_alone(
    staged_run, hub, tmp_path, token_env
):
    api = api_for(hub)
    message = "Release v1: the tiny model"  # 06 --message: the commit's title
    result = publish_here(
        staged_run.stage, hub, "alice/branch", tmp_path, revision="dev", private=True, message=message
    )
    assert (result.status, result.plan.revision) == ("published", "dev")
    assert [c.title for c in api.list_repo_commits("alice/branch", revision="dev")] == [
        message,
        "initial commit",
    ]
    assert api.repo_info("alice/branch", revision="dev").sha == result.commit
    created = api.repo_info("alice/branch")  # the repo was missing: created as asked, main left as created
    main = created.sha
    assert created.private is True and commit_titles(hub, "alice/branch") == ["initial commit"]
    record = json.loads(result.receipt.read_text())
    assert (record["revision"], record["parent_commit"], record["commit"]) == ("dev", main, result.commit)
    assert set(api.list_repo_files("alice/branch", revision="dev")) == stage_files(staged_run.stage) | {
        ".gitattributes"
    }


def test_a_publish_to_a_new_branch_of_an_existing_repo_creates_the_branch_and_leaves_main_alone(
    staged_run, hub, tmp_path, token_env
):
    """The repo exists (main holds someone's notes): the branch alone is created, from main, and
    the one commit on it holds exactly the stage (the notes deleted there); main does not move."""
    api = api_for(hub)
    api.create_repo("alice/existing")
    api.upload_file(path_or_fileobj=b"notes", path_in_repo="notes.txt", repo_id="alice/existing")
    main = api.repo_info("alice/existing").sha
    said: list[str] = []
    result = publish_here(staged_run.stage, hub, "alice/existing", tmp_path, revision="dev", say=said.append)
    assert (result.status, result.plan.revision, result.plan.head) == ("published", "dev", main)
    assert result.plan.deletions == ("notes.txt",)
    # After the audit's line: the branch alone is created (the repo is not), from main's head.
    assert said[1:] == [
        "creating branch dev from main",
        f"committing {len(stage_files(staged_run.stage))} new or changed file(s) and 1 deletion(s) onto "
        f"{main[:12]} of dev",
        f"verifying {result.commit[:12]}: the Hub's LFS SHA-256s and Xet hashes, downloaded small files",
    ]
    branches = {b.name: b.target_commit for b in api.list_repo_refs("alice/existing").branches}
    assert branches == {"main": main, "dev": result.commit}
    history = [c.commit_id for c in api.list_repo_commits("alice/existing", revision="dev")]
    assert history[:2] == [result.commit, main]
    assert_holds_exactly_the_stage(hub, "alice/existing", staged_run.stage, revision="dev")
    assert set(api.list_repo_files("alice/existing")) == {".gitattributes", "notes.txt"}
    record = json.loads(result.receipt.read_text())
    assert (record["revision"], record["parent_commit"], record["commit"]) == ("dev", main, result.commit)


def test_a_lost_commit_answer_and_a_branch_head_that_cannot_be_read_say_the_commit_may_have_landed(
    staged_run, hub, tmp_path, token_env, monkeypatch, waits
):
    def connection_lost(self, repo_id, *args, **kwargs):
        # The commit's connection breaks; from then on the Hub answers every read of the head 503.
        hub.rate_limit_next(times=1000, retry_after=None, method="GET", path=r"/revision/main$", status=503)
        raise httpx2.ConnectError("connection reset by peer")

    monkeypatch.setattr(HfApi, "create_commit", connection_lost)
    with pytest.raises(UploadInterrupted) as interrupted:
        publish_here(staged_run.stage, hub, "alice/unknowable", tmp_path)
    message = str(interrupted.value)
    assert interrupted.value.exit_code == 2
    assert message.startswith(
        f"connection to {hub.url} lost (ConnectError: connection reset by peer) while uploading and "
        "committing, and the branch head could not be read afterwards (the Hub answered HTTP 503 "
    ), message
    assert message.endswith(
        "the commit may or may not have landed; rerun: it finds a landed commit and never makes a second one"
    ), message


def test_dropped_uploads_leave_no_commit_and_a_rerun_lands_exactly_one(
    staged_run, hub, tmp_path, token_env, no_client_sleep
):
    hub.drop_next_upload(times=100)  # every LFS file (weights, curve, traces): each try and retry
    with pytest.raises(UploadInterrupted) as refused:
        publish_here(staged_run.stage, hub, "alice/dropped", tmp_path)
    message = str(refused.value)
    assert refused.value.exit_code == 2 and message.startswith(f"connection to {hub.url} lost ("), message
    assert message.endswith(
        " while uploading and committing, and the head of main did not move: nothing was committed; "
        "rerun: it skips blobs already uploaded and never makes a second commit"
    ), message
    assert hub.count("POST", r"/commit/") == 0
    assert commit_titles(hub, "alice/dropped") == ["initial commit"]

    hub.clear_faults()
    result = publish_here(staged_run.stage, hub, "alice/dropped", tmp_path)
    assert result.status == "published" and len(commit_titles(hub, "alice/dropped")) == 2
    assert_holds_exactly_the_stage(hub, "alice/dropped", staged_run.stage)


# -- Xet faults (in process, the client on its default Xet path) ------------------------------


def stored(hub: LocalHub, kind: str) -> list[Path]:
    """Files the hub's Xet CAS holds under ``kind`` ("xorbs", "shards", ...)."""
    return sorted(p for p in (hub.store.xet.root / kind).rglob("*") if p.is_file())


def cas_post(hub: LocalHub, repo_id: str, path: str, body: bytes) -> httpx2.Response:
    """POST to the CAS with a write token obtained from the Hub, as the Xet client does."""
    answer = httpx2.get(
        f"{hub.url}/api/models/{repo_id}/xet-write-token/main", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    grant = answer.json()
    assert answer.headers["X-Xet-Access-Token"] == grant["accessToken"] and grant["exp"] > 0
    return httpx2.post(
        f"{grant['casUrl']}/{path}", content=body, headers={"Authorization": f"Bearer {grant['accessToken']}"}
    )


def test_corrupted_xorb_is_refused_by_the_cas_and_nothing_is_committed(
    staged_run, hub, tmp_path, token_env, xet
):
    hub.corrupt_next_xorb(times=50)  # one byte flipped after the client hashed the xorb, every try
    with pytest.raises(UploadInterrupted) as refused:
        publish_here(staged_run.stage, hub, "alice/corrupted", tmp_path)
    assert refused.value.exit_code == 2 and "400 Bad Request" in str(refused.value)
    assert hub.count("POST", r"/commit/") == 0 and commit_titles(hub, "alice/corrupted") == ["initial commit"]
    assert hub.count("POST", r"/v1/xorbs/") >= 1 and stored(hub, "xorbs") == []

    hub.clear_faults()
    result = publish_here(staged_run.stage, hub, "alice/corrupted", tmp_path)
    assert result.status == "published" and len(commit_titles(hub, "alice/corrupted")) == 2
    assert_holds_exactly_the_stage(hub, "alice/corrupted", staged_run.stage)

    # The same refusal by the CAS itself, on a xorb the real client made: one byte of chunk data changed.
    xorb = stored(hub, "xorbs")[0]
    data = bytearray(xorb.read_bytes())
    data[len(data) // 3] ^= 0x01
    answer = cas_post(hub, "alice/corrupted", f"v1/xorbs/default/{xorb.name}", bytes(data))
    assert answer.status_code == 400 and "refused" in answer.json()["error"]
    assert cas_post(hub, "alice/corrupted", f"v1/xorbs/default/{xorb.name}", xorb.read_bytes()).json() == {
        "was_inserted": False
    }
    # A shard whose file hash does not match its chunks is refused too, and records nothing.
    shard = bytearray(stored(hub, "shards")[0].read_bytes())
    shard[48] ^= 0x01  # first byte of the first file's hash
    answer = cas_post(hub, "alice/corrupted", "v1/shards", bytes(shard))
    assert answer.status_code == 400 and "file hash" in answer.json()["error"]
    assert len(stored(hub, "shards")) == 1


def test_xet_token_revoked_mid_upload_leaves_no_commit_and_a_rerun_lands_one(
    staged_run, hub, tmp_path, token_env, xet
):
    hub.expire_xet_tokens(after_requests=2)  # the token dies after the dedup queries, before the xorb
    with pytest.raises(UploadInterrupted) as refused:
        publish_here(staged_run.stage, hub, "alice/xet-revoked", tmp_path)
    assert "401" in str(refused.value) and commit_titles(hub, "alice/xet-revoked") == ["initial commit"]

    result = publish_here(staged_run.stage, hub, "alice/xet-revoked", tmp_path)
    assert result.status == "published" and len(commit_titles(hub, "alice/xet-revoked")) == 2


def test_xet_tokens_expiring_during_the_upload_are_refreshed_and_one_commit_lands(
    staged_run, tmp_path, token_env, xet
):
    with LocalHub(tmp_path / "short", token=TOKEN, xet_token_ttl=2) as hub:  # shorter than one upload
        result = publish_here(staged_run.stage, hub, "alice/xet-refreshed", tmp_path)
        assert result.status == "published" and len(commit_titles(hub, "alice/xet-refreshed")) == 2
        assert hub.count("GET", r"/xet-write-token/") >= 2
        assert_holds_exactly_the_stage(hub, "alice/xet-refreshed", staged_run.stage)


def test_rate_limited_commit_waits_retry_after_then_lands(staged_run, hub, tmp_path, token_env, waits):
    hub.rate_limit_next(times=2, retry_after=7, method="POST", path=r"/commit/main$")
    result = publish_here(staged_run.stage, hub, "alice/limited", tmp_path)
    assert result.status == "published" and waits == [7.0, 7.0]
    assert hub.count("POST", r"/commit/main$") == 3
    assert len(commit_titles(hub, "alice/limited")) == 2


def test_retry_after_beyond_the_deadline_gives_up_at_once_without_committing(
    staged_run, hub, tmp_path, token_env, waits
):
    hub.rate_limit_next(times=1, retry_after=3600, method="POST", path=r"/commit/main$")
    with pytest.raises(PublishTimedOut) as refused:
        publish_here(staged_run.stage, hub, "alice/patient", tmp_path, timeout_s=60)
    message = str(refused.value)
    assert "cannot finish within its 60s --timeout" in message, message
    assert "the Hub asks to wait 3600s before retrying the commit" in message, message
    assert "nothing was committed" in message and waits == []
    assert commit_titles(hub, "alice/patient") == ["initial commit"]


def test_push_after_the_head_was_read_fails_with_412_and_overwrites_nothing(
    staged_run, hub, tmp_path, token_env, monkeypatch
):
    rival = api_for(hub)
    real_create_commit = HfApi.create_commit

    def someone_pushes_first(self, repo_id, operations, **kwargs):
        # Between our read of the head and our commit, another client pushes to the branch.
        real_create_commit(
            rival, repo_id, [CommitOperationAdd("notes.txt", b"theirs\n")], commit_message="theirs"
        )
        return real_create_commit(self, repo_id, operations, **kwargs)

    api_for(hub).create_repo("alice/contested")
    monkeypatch.setattr(HfApi, "create_commit", someone_pushes_first)
    with pytest.raises(StaleBranch) as refused:
        publish_here(staged_run.stage, hub, "alice/contested", tmp_path)
    assert refused.value.exit_code == 2
    assert "someone pushed to main" in str(refused.value) and "nothing was written" in str(refused.value)
    assert commit_titles(hub, "alice/contested") == ["theirs", "initial commit"]
    assert sorted(api_for(hub).list_repo_files("alice/contested")) == [".gitattributes", "notes.txt"]


def test_dry_run_plans_the_commit_and_sends_no_write_request(
    staged_run, hub, tmp_path, token_env, monkeypatch
):
    result = publish_here(staged_run.stage, hub, "alice/planned", tmp_path, dry_run=True)
    assert result.status == "dry run" and write_requests(hub) == 0
    monkeypatch.delenv("HF_TOKEN")  # a plan needs no token; a publish does
    assert publish_here(staged_run.stage, hub, "alice/planned", tmp_path, dry_run=True).status == "dry run"
    with pytest.raises(TokenRejected) as refused:
        publish_here(staged_run.stage, hub, "alice/planned", tmp_path)
    assert str(refused.value) == (
        "no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token is never taken from the command "
        "line); nothing was published"
    )
    assert write_requests(hub) == 0
    with pytest.raises(RepositoryNotFoundError):
        api_for(hub).repo_info("alice/planned")
    text = format_plan(result.plan)
    assert f"{hub.url}/alice/planned" in text
    for name, sha in parse_manifest((staged_run.stage / "MANIFEST.sha256").read_bytes()).items():
        size = (staged_run.stage / name).stat().st_size
        assert any(name in line and f"{size} B" in line and sha in line for line in text.splitlines()), name
    assert not (tmp_path / "receipts").exists()


def test_upload_reuses_the_audit_sha256_instead_of_hashing_again(
    staged_run, hub, tmp_path, token_env, monkeypatch
):
    def hashed_again(fileobj, *args, **kwargs):
        raise AssertionError("the client hashed a staged file a second time")

    monkeypatch.setattr(hf_lfs, "sha_fileobj", hashed_again)
    result = publish_here(staged_run.stage, hub, "alice/hashed-once", tmp_path)
    assert result.status == "published"
    assert_holds_exactly_the_stage(hub, "alice/hashed-once", staged_run.stage)


def bytes_read() -> int:
    """Bytes this process has read with read(2) and its kin, from files, pipes and sockets, by
    Python and native code alike (Linux's per-process I/O accounting)."""
    counters = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(counters["rchar"])


@pytest.mark.parametrize("protocol", ["lfs", "xet"])
def test_each_staged_byte_is_read_once_to_hash_it_and_once_to_send_it(
    staged_run, run_copy, tmp_path, token_env, monkeypatch, protocol
):
    use_protocol(monkeypatch, protocol)
    stage = run_copy(staged_run).stage
    big = stage / "weights_extra.bin"
    big.write_bytes(os.urandom(24 << 20))
    with open(stage / "MANIFEST.sha256", "a") as manifest:
        manifest.write(f"{hashlib.sha256(big.read_bytes()).hexdigest()}  {big.name}\n")
    rest = sum(f.stat().st_size for f in stage.rglob("*") if f.is_file()) - big.stat().st_size
    import hf_xet

    hashed_paths: list[str] = []
    real_hash_files = hf_xet.hash_files

    def hash_files(paths):
        hashed_paths.extend(paths)
        return real_hash_files(paths)

    monkeypatch.setattr(hf_xet, "hash_files", hash_files)
    with LocalHubProcess(tmp_path / "hub", token=TOKEN) as hub:  # its own reads are not this process's
        publish_here(staged_run.stage, hub, "alice/warm-up", tmp_path)  # modules imported, connections open
        before = bytes_read()
        result = publish_here(stage, hub, "alice/read-once", tmp_path, force_repo_id=True)
        read = bytes_read() - before
    assert result.status == "published" and all(f.ok for f in result.files)
    # The audit's read (SHA-256, leak scan and, over Xet, the Xet hash) and the upload's; over Xet,
    # hf_xet also reads the audited bytes once from the pipe the audit writes them into. Besides:
    # the small files a few times, and a new Xet session reads the system's CA certificates (MBs).
    passes = 2 if protocol == "lfs" else 3
    assert passes * big.stat().st_size <= read <= passes * big.stat().st_size + 4 * rest + (4 << 20), read
    staged = {str(path) for path in stage.rglob("*")}
    assert not staged & set(map(str, hashed_paths)), "hf_xet read a staged file itself to hash it"
    if protocol == "xet":
        audited = {entry.name: entry for entry in result.audited}
        assert audited[big.name].xet_hash == real_hash_files([str(big)])[0].hash


def requests_by_kind(hub: LocalHub) -> dict[str, int]:
    """The Hub's request counts by what they do (a download counts once per file)."""
    kinds = {
        "head": r"^GET /api/models/[^/]+/[^/]+/revision/",
        "listing": r"^GET /api/models/[^/]+/[^/]+/tree/",
        "download": r"^GET /[^_][^/]*/[^/]+/resolve/",
        "probe": r"^HEAD ",
        "LFS batch": r"^POST .*/objects/batch$",
        "LFS upload": r"^PUT /_localhub/lfs/",
        "commit": r"^POST /api/models/.*/commit/",
    }
    counts = dict.fromkeys(kinds, 0)
    for key, n in hub.request_counts().items():
        for kind, pattern in kinds.items():
            if re.search(pattern, key):
                counts[kind] += n
    return counts


def test_the_plan_and_the_check_after_landing_send_only_the_requests_they_need(
    staged_run, run_copy, hub, tmp_path, token_env
):
    stage = run_copy(staged_run).stage
    manifest = parse_manifest((stage / "MANIFEST.sha256").read_bytes())
    published = publish_here(stage, hub, "alice/counted", tmp_path)
    regular = sum(f.storage.value == "regular" for f in published.files)
    lfs = sum(f.storage.value == "lfs" for f in published.files)
    assert regular + lfs == len(manifest) + 1 and lfs >= 1  # the manifest itself is published too
    # The head before and after creating the repo; the repo info lists its files (only
    # .gitattributes), so no file listing before the commit; one to verify it; each small file
    # downloaded once (no HEAD request first).
    assert requests_by_kind(hub) == {
        "head": 2,
        "listing": 1,
        "download": regular,
        "probe": 0,
        "LFS batch": 1,
        "LFS upload": lfs,
        "commit": 1,
    }

    hub.reset_request_counts()
    again = publish_here(stage, hub, "alice/counted", tmp_path)
    assert again.status == "already published"
    # The listing the plan read (for the Xet hashes) is the one the check after landing uses.
    assert requests_by_kind(hub) == {
        **dict.fromkeys(requests_by_kind(hub), 0),
        "head": 1,
        "listing": 1,
        "download": regular,
    }

    hub.reset_request_counts()
    card = stage / "README.md"
    card.write_text(card.read_text() + "\nA note.\n")
    with open(stage / "MANIFEST.sha256", "w") as out:
        out.writelines(
            f"{hashlib.sha256((stage / name).read_bytes()).hexdigest()}  {name}\n"
            for name in sorted(manifest)
        )
    changed = publish_here(stage, hub, "alice/counted", tmp_path)
    assert changed.status == "published"
    assert [f.name for f in changed.plan.files if f.action != "unchanged"] == ["MANIFEST.sha256", "README.md"]
    # Unchanged LFS files are not handed to the client: no LFS batch request, nothing uploaded.
    counted = requests_by_kind(hub)
    assert counted["LFS batch"] == 0 and counted["LFS upload"] == 0 and counted["commit"] == 1, counted


def test_a_no_op_rerun_writes_the_receipt_anew_when_it_was_deleted_and_keeps_it_when_it_is_there(
    staged_run, hub, tmp_path, token_env
):
    """A no-op rerun keeps the receipt of the publish itself, writes it anew when it was
    deleted, and replaces it when the check after landing now finds a difference: a receipt
    that still said verified would hide what the Hub no longer shows."""
    first = publish_here(staged_run.stage, hub, "alice/receipted", tmp_path)
    receipt = tmp_path / "receipts" / f"alice--receipted-{first.commit[:12]}.json"
    assert (first.status, first.receipt, first.receipt_written) == ("published", receipt, True)
    kept = publish_here(staged_run.stage, hub, "alice/receipted", tmp_path)
    assert (kept.status, kept.receipt, kept.receipt_written) == ("already published", receipt, False)
    assert json.loads(receipt.read_text())["status"] == "published"
    receipt.unlink()  # the receipt folder emptied: the rerun is the only record left to write
    again = publish_here(staged_run.stage, hub, "alice/receipted", tmp_path)
    assert (again.status, again.commit, again.receipt, again.receipt_written) == (
        "already published",
        first.commit,
        receipt,
        True,
    )
    assert sorted(p.name for p in receipt.parent.iterdir()) == [receipt.name]
    record = json.loads(receipt.read_text())
    assert {
        key: record[key] for key in ("status", "repo_id", "commit", "parent_commit", "verified", "problems")
    } == {
        "status": "already published",
        "repo_id": "alice/receipted",
        "commit": first.commit,
        "parent_commit": None,
        "verified": True,
        "problems": [],
    }
    assert len(commit_titles(hub, "alice/receipted")) == 2

    # The Hub now refuses to serve the card: the rerun plans nothing (the listing is unchanged),
    # but cannot verify it, so its receipt records that instead of keeping "verified".
    hub.rate_limit_next(
        times=1,
        retry_after=None,
        method="GET",
        path=r"/alice/receipted/resolve/[0-9a-f]{40}/README\.md$",
        status=403,
    )
    problem = "README.md: the Hub answers HTTP 403 to its download, so it cannot be checked"
    with pytest.raises(VerificationFailed) as failed:
        publish_here(staged_run.stage, hub, "alice/receipted", tmp_path)
    assert str(failed.value) == (
        f"commit {hub.url}/alice/receipted/commit/{first.commit} landed but differs from the audited stage: "
        f"{problem}; receipt {receipt}"
    )
    assert sorted(p.name for p in receipt.parent.iterdir()) == [receipt.name]
    refused = json.loads(receipt.read_text())
    card = {**record["files"]["README.md"], "checked_by": "download refused", "found": None, "ok": False}
    assert refused == {
        **record,
        "time": refused["time"],
        "verified": False,
        "problems": [problem],
        "files": {**record["files"], "README.md": card},
    }
    assert len(commit_titles(hub, "alice/receipted")) == 2


def test_stale_files_in_the_target_folder_are_deleted_in_the_same_single_commit(
    staged_run, hub, tmp_path, token_env
):
    publish_here(staged_run.stage, hub, "alice/folder", tmp_path, path_in_repo="model")
    api_for(hub).create_commit(
        "alice/folder",
        [CommitOperationAdd("model/old.bin", b"\0old"), CommitOperationAdd("notes.txt", b"outside\n")],
        commit_message="someone adds files",
    )
    before = len(commit_titles(hub, "alice/folder"))
    result = publish_here(staged_run.stage, hub, "alice/folder", tmp_path, path_in_repo="model")
    assert result.status == "published" and result.plan.deletions == ("model/old.bin",)
    assert len(commit_titles(hub, "alice/folder")) == before + 1
    assert_holds_exactly_the_stage(hub, "alice/folder", staged_run.stage, prefix="model/")
    assert {".gitattributes", "notes.txt"} <= set(api_for(hub).list_repo_files("alice/folder"))


def test_commit_that_lands_with_other_bytes_fails_verification_with_exit_1(
    staged_run, hub, tmp_path, token_env, monkeypatch
):
    real_create_commit = HfApi.create_commit
    card_sha = parse_manifest((staged_run.stage / "MANIFEST.sha256").read_bytes())["README.md"]

    def storage_corrupts_the_card(self, *args, **kwargs):
        info = real_create_commit(self, *args, **kwargs)
        stored = hub.store.object_path(card_sha)
        data = bytearray(stored.read_bytes())
        data[0] ^= 0x01  # same size, one bit flipped at rest
        stored.write_bytes(bytes(data))
        return info

    monkeypatch.setattr(HfApi, "create_commit", storage_corrupts_the_card)
    with pytest.raises(VerificationFailed) as failed:
        publish_here(staged_run.stage, hub, "alice/corrupt", tmp_path)
    assert failed.value.exit_code == 1 and "README.md" in str(failed.value)
    [receipt] = list((tmp_path / "receipts").glob("*.json"))
    record = json.loads(receipt.read_text())
    assert record["verified"] is False and not record["files"]["README.md"]["ok"]


def test_tag_pins_the_published_commit_and_create_pr_leaves_the_branch_alone(
    staged_run, run_copy, hub, tmp_path, token_env
):
    receipts = tmp_path / "receipts"
    api = api_for(hub)
    first = run_publish(staged_run.stage, hub, "alice/tagged", receipts, "--tag", "v1")
    assert first.returncode == 0, first.stdout + first.stderr
    main = api.repo_info("alice/tagged").sha
    assert [(t.name, t.target_commit) for t in api.list_repo_refs("alice/tagged").tags] == [("v1", main)]
    pinned = Path(
        snapshot_download(
            "alice/tagged", revision="v1", endpoint=hub.url, token=TOKEN, cache_dir=tmp_path / "cache"
        )
    )
    assert (pinned / "meta.json").read_bytes() == (staged_run.stage / "meta.json").read_bytes()
    again = run_publish(staged_run.stage, hub, "alice/tagged", receipts, "--tag", "v1")
    assert again.returncode == 0 and "nothing to publish" in again.stdout, again.stdout + again.stderr

    changed = run_copy(staged_run)
    changed.ok("05_stage.py", "--set", "card.description=A second version.")
    moved = run_publish(changed.stage, hub, "alice/tagged", receipts, "--tag", "v1")
    assert "tag v1 of alice/tagged already names commit" in one_error_line(moved)
    assert api.repo_info("alice/tagged").sha == main, "a refused tag sends nothing"

    pr = run_publish(changed.stage, hub, "alice/tagged", receipts, "--create-pr")
    assert pr.returncode == 0 and "as a pull request against main" in pr.stdout, pr.stdout + pr.stderr
    assert api.repo_info("alice/tagged").sha == main, "the branch did not move"
    pulls = api.list_repo_refs("alice/tagged", include_pull_requests=True).pull_requests
    assert [p.ref for p in pulls] == ["refs/pr/1"]
    proposed = api.hf_hub_download(
        "alice/tagged", "README.md", revision="refs/pr/1", cache_dir=tmp_path / "c2"
    )
    assert Path(proposed).read_bytes() == (changed.stage / "README.md").read_bytes()
    assert api.list_repo_commits("alice/tagged", revision="refs/pr/1")[0].commit_id == pulls[0].target_commit

    # The branch then holds the changed stage; the tag still names the first commit, which does not.
    assert publish_here(changed.stage, hub, "alice/tagged", tmp_path).status == "published"
    with pytest.raises(PublishError) as kept:
        publish_here(changed.stage, hub, "alice/tagged", tmp_path, tag="v1")
    assert str(kept.value) == (
        f"tag v1 of alice/tagged already names commit {main[:12]}, which does not hold this stage; "
        "tags are never moved: choose another --tag; nothing was sent"
    )
    assert [(t.name, t.target_commit) for t in api.list_repo_refs("alice/tagged").tags] == [("v1", main)]


def test_a_hub_listing_another_xet_hash_fails_verification_without_reading_the_weights_back(
    staged_run, hub, tmp_path, token_env, xet
):
    hub.list_other_xet_hash()  # the weights' entry names other chunks than the ones uploaded
    with pytest.raises(VerificationFailed) as failed:
        publish_here(staged_run.stage, hub, "alice/other-chunks", tmp_path)
    message = str(failed.value)
    assert failed.value.exit_code == 1 and "modelo.safetensors: the Hub lists Xet hash" in message, message
    [receipt] = list((tmp_path / "receipts").glob("*.json"))
    record = json.loads(receipt.read_text())
    weights = record["files"]["modelo.safetensors"]
    assert record["verified"] is False and (weights["storage"], weights["checked_by"]) == (
        "xet",
        "Hub Xet hash",
    )
    assert [name for name, entry in record["files"].items() if not entry["ok"]] == ["modelo.safetensors"]
    assert hub.count("GET", r"/reconstructions/|/_xet/data/") == 0


def test_a_xet_file_the_hub_holds_other_bytes_for_is_repaired_by_a_rerun_in_one_commit(
    staged_run, hub, tmp_path, token_env, xet
):
    hub.store_other_xet_file()  # the weights' SHA-256 now names another file's Xet file (other bytes)
    with pytest.raises(VerificationFailed) as failed:
        publish_here(staged_run.stage, hub, "alice/repaired", tmp_path)
    assert "modelo.safetensors: the Hub lists Xet hash" in str(failed.value), failed.value

    # The branch holds the weights' SHA-256, but not their Xet hash: the rerun uploads and commits them again.
    result = publish_here(staged_run.stage, hub, "alice/repaired", tmp_path)
    actions = {f.name: f.action for f in result.plan.files}
    assert actions.pop("modelo.safetensors") == "repair" and set(actions.values()) == {"unchanged"}, actions
    assert result.status == "published" and all(f.ok for f in result.files)
    assert len(commit_titles(hub, "alice/repaired")) == 3
    listed = {f.path: f for f in api_for(hub).list_repo_tree("alice/repaired") if hasattr(f, "blob_id")}
    audited = {entry.name: entry for entry in result.audited}
    assert listed["modelo.safetensors"].xet_hash == audited["modelo.safetensors"].xet_hash
    served = api_for(hub).hf_hub_download(
        "alice/repaired", "modelo.safetensors", cache_dir=tmp_path / "cache"
    )
    assert Path(served).read_bytes() == (staged_run.stage / "modelo.safetensors").read_bytes()

    again = publish_here(staged_run.stage, hub, "alice/repaired", tmp_path)
    assert again.status == "already published" and len(commit_titles(hub, "alice/repaired")) == 3


def test_a_file_the_audit_did_not_xet_hash_is_repaired_when_the_hub_stores_other_bytes_by_xet(tmp_path):
    """An audit that computed no Xet hash (an LFS publish keeping a file the branch stores over
    Xet) leaves the plan to hash the staged file: a Xet entry listing the staged SHA-256 but the
    Xet hash of other bytes is a repair, the one listing our bytes' Xet hash unchanged."""
    hf_xet = pytest.importorskip("hf_xet")
    from pipeline.publishing.plan import compare
    from pipeline.publishing.xet import StagedXetHashes

    stage = tmp_path / "stage"
    stage.mkdir()
    ours, other = b"weights " * 4096, b"WEIGHTS " * 4096  # same size, other bytes
    (stage / "modelo.safetensors").write_bytes(ours)
    (tmp_path / "other").write_bytes(other)
    their_xet, our_xet = (
        info.hash for info in hf_xet.hash_files([str(tmp_path / "other"), str(stage / "modelo.safetensors")])
    )
    sha = hashlib.sha256(ours).hexdigest()
    audited = {"modelo.safetensors": AuditedFile("modelo.safetensors", len(ours), sha, "MANIFEST.sha256")}
    assert audited["modelo.safetensors"].xet_hash is None
    for listed, action in ((their_xet, "repair"), (our_xet, "unchanged")):
        remote = {"modelo.safetensors": RemoteFile("modelo.safetensors", len(ours), "0" * 40, sha, listed)}
        files, _ = compare(stage, audited, remote, "", StagedXetHashes(stage, audited))
        assert [(f.name, f.action) for f in files] == [("modelo.safetensors", action)], (listed, files)


def test_without_hf_xet_installed_no_file_is_xet_hashed_and_the_audit_feeds_no_pipe(tmp_path, monkeypatch):
    """Without hf_xet the client uploads over LFS: every Xet hash asked for is None (a Xet-stored
    file is then downloaded to be verified) and the audit's read hashes no pipe. A file the branch
    stores over Xet with the staged size and SHA-256 is then left as it is, not uploaded again."""
    from pipeline.publishing import xet
    from pipeline.publishing.plan import PlannedFile, compare

    for name in ("modelo.safetensors", "config.json"):
        (tmp_path / name).write_bytes(b"weights")
    monkeypatch.setitem(sys.modules, "hf_xet", None)  # not installed: importlib finds no hf_xet
    assert xet.hash_files([tmp_path / "modelo.safetensors", tmp_path / "config.json"]) == [None, None]
    assert xet.new_digest() is None and not xet.client_uploads_over_xet()
    sha = hashlib.sha256(b"weights").hexdigest()
    audited = {"modelo.safetensors": AuditedFile("modelo.safetensors", 7, sha, "MANIFEST.sha256")}
    assert xet.StagedXetHashes(tmp_path, audited).of("modelo.safetensors") is None
    remote = {"modelo.safetensors": RemoteFile("modelo.safetensors", 7, "0" * 40, sha, "1" * 64)}
    files, deletions = compare(tmp_path, audited, remote, "", xet.StagedXetHashes(tmp_path, audited))
    assert (files, deletions) == (
        (PlannedFile("modelo.safetensors", "modelo.safetensors", 7, sha, "unchanged"),),
        (),
    )


def test_a_xet_file_under_path_in_repo_is_repaired_by_a_rerun_in_one_commit(
    staged_run, hub, tmp_path, token_env, xet
):
    """The repair of a Xet-stored file, with the stage published into a folder of the repo: the
    rerun compares model/modelo.safetensors (not modelo.safetensors at the root) by its Xet hash,
    deletes and uploads it again there in one commit, and nothing lands at the root."""
    hub.store_other_xet_file()
    with pytest.raises(VerificationFailed) as failed:
        publish_here(staged_run.stage, hub, "alice/repaired-in-folder", tmp_path, path_in_repo="model")
    assert "model/modelo.safetensors: the Hub lists Xet hash" in str(failed.value), failed.value

    result = publish_here(staged_run.stage, hub, "alice/repaired-in-folder", tmp_path, path_in_repo="model")
    actions = {f.path_in_repo: f.action for f in result.plan.files}
    assert actions.pop("model/modelo.safetensors") == "repair" and set(actions.values()) == {"unchanged"}, (
        actions
    )
    assert result.status == "published" and all(f.ok for f in result.files)
    assert len(commit_titles(hub, "alice/repaired-in-folder")) == 3
    assert_holds_exactly_the_stage(hub, "alice/repaired-in-folder", staged_run.stage, prefix="model/")
    listed = {
        f.path: f
        for f in api_for(hub).list_repo_tree("alice/repaired-in-folder", "model", recursive=True)
        if hasattr(f, "blob_id")
    }
    audited = {entry.name: entry for entry in result.audited}
    assert listed["model/modelo.safetensors"].xet_hash == audited["modelo.safetensors"].xet_hash
    served = api_for(hub).hf_hub_download(
        "alice/repaired-in-folder", "model/modelo.safetensors", cache_dir=tmp_path / "cache"
    )
    assert Path(served).read_bytes() == (staged_run.stage / "modelo.safetensors").read_bytes()
    again = publish_here(staged_run.stage, hub, "alice/repaired-in-folder", tmp_path, path_in_repo="model")
    assert again.status == "already published" and len(commit_titles(hub, "alice/repaired-in-folder")) == 3


def test_a_xet_file_is_verified_by_its_own_bytes_when_the_audit_has_no_xet_hash(
    staged_run, hub, tmp_path, token_env, xet, monkeypatch
):
    import hf_xet

    def unavailable(paths):
        raise RuntimeError("hf_xet cannot hash here")

    monkeypatch.setattr(hf_xet, "hash_files", unavailable)  # the audit and the check get no Xet hash
    hub.list_other_xet_hash()  # the weights are listed with other chunks than the ones uploaded
    with pytest.raises(VerificationFailed) as failed:
        publish_here(staged_run.stage, hub, "alice/no-xet-hash", tmp_path)
    assert failed.value.exit_code == 1 and "modelo.safetensors" in str(failed.value), failed.value
    [receipt] = list((tmp_path / "receipts").glob("*.json"))
    weights = json.loads(receipt.read_text())["files"]["modelo.safetensors"]
    assert weights["storage"] == "xet" and not weights["ok"]


def test_without_a_xet_hash_the_downloaded_bytes_of_a_xet_file_must_hash_to_the_audits_sha256():
    """With no hf_xet here a Xet-stored file is checked by downloading it: bytes that hash to
    anything but the audit's SHA-256 are a problem naming both hashes, bytes past the audited size
    one naming that size; the audited bytes are not.
    (The loopback Hub cannot serve other bytes for a Xet file: huggingface_hub's download refuses
    them first, so the check itself is called here with the hash a download gave.)"""
    audited, other = "a" * 64, "d" * 64
    expected = AuditedFile(name="modelo.safetensors", size=4, sha256=audited, verified_against="meta.json")
    remote = RemoteFile(
        path="modelo.safetensors", size=4, blob_id="b" * 40, sha256=audited, xet_hash="c" * 64
    )
    damaged = check_landed("modelo.safetensors", expected, remote, None, lambda: other)
    assert (damaged.found, damaged.checked_by) == (other, "downloaded bytes (Xet)")
    assert damaged.problem == (
        f"modelo.safetensors: the Hub holds SHA-256 {other} (downloaded bytes (Xet)), the audit {audited}"
    )
    longer = check_landed("modelo.safetensors", expected, remote, None, lambda: None)  # past the audited size
    assert (longer.found, longer.checked_by, longer.problem) == (
        None,
        "downloaded bytes (Xet)",
        "modelo.safetensors: the Hub serves more than the audit's 4 bytes (Xet)",
    )
    intact = check_landed("modelo.safetensors", expected, remote, None, lambda: audited)
    assert (intact.found, intact.problem) == (audited, None)


def test_an_lfs_record_of_the_audited_sha256_but_another_size_is_a_problem_naming_both_sizes():
    """The Hub's LFS record is the check of an LFS file (nothing is downloaded): a record listing
    the audited SHA-256 with another size (larger, smaller, 0) is not the audited file (the file
    is not ok and the problem names both sizes), nor one of the audited size with another SHA-256
    (the problem names both hashes); the record of the audited size and SHA-256 is. Each problem
    names the file by its path in the repo, at the root and in a folder."""
    from huggingface_hub import HfApi

    from pipeline.publishing.client import Target
    from pipeline.publishing.verify import verify_commit
    from pipeline.publishing.xet import StagedXetHashes, Storage

    sha, other = "a" * 64, "d" * 64
    unreachable = "http://127.0.0.1:9"  # an LFS file is checked by its record: no request is made
    for prefix in ("", "run/"):
        path = f"{prefix}modelo.safetensors"
        expected = {path: AuditedFile("modelo.safetensors", 4, sha, "meta.json")}
        with Deadline(10).installed() as limit:
            target = Target(
                HfApi(endpoint=unreachable), unreachable, "alice/sizes", "main", prefix, None, limit
            )
            for size, listed, problems in (
                (5, sha, [f"{path}: the Hub's LFS record lists 5 bytes, the audit 4"]),
                (3, sha, [f"{path}: the Hub's LFS record lists 3 bytes, the audit 4"]),
                (0, sha, [f"{path}: the Hub's LFS record lists 0 bytes, the audit 4"]),
                (4, other, [f"{path}: the Hub holds SHA-256 {other} (Hub LFS SHA-256), the audit {sha}"]),
                (4, sha, []),
            ):
                remote = {path: RemoteFile(path, size, "b" * 40, listed)}
                [checked], found = verify_commit(
                    target, "c" * 40, expected, remote, frozenset(), StagedXetHashes(Path("."), expected)
                )
                assert (checked.path_in_repo, checked.storage, checked.checked_by, checked.ok, found) == (
                    path,
                    Storage.LFS,
                    "Hub LFS SHA-256",
                    not problems,
                    problems,
                ), (prefix, size, listed)


def test_a_downloaded_file_longer_than_the_audit_is_a_problem_naming_the_audited_size(hub):
    """A regular file is checked by its bytes, downloaded from the commit and never read past
    the audited size: one the Hub serves longer is reported by that size (its hash is never
    taken, so there is none to name), one of the audited bytes verifies."""
    from pipeline.publishing.client import Target
    from pipeline.publishing.verify import verify_commit
    from pipeline.publishing.xet import StagedXetHashes, Storage

    api = api_for(hub)
    api.create_repo("alice/longer")
    commit = api.upload_file(
        path_or_fileobj=b"hello world\n", path_in_repo="notes.txt", repo_id="alice/longer"
    ).oid
    remote = {"notes.txt": RemoteFile("notes.txt", 12, "b" * 40)}
    with Deadline(10).installed() as limit:
        target = Target(api, hub.url, "alice/longer", "main", "", TOKEN, limit)
        for audited, problems in (
            (b"hello", ["notes.txt: the Hub serves more than the audit's 5 bytes"]),
            (b"hello world\n", []),
        ):
            sha = hashlib.sha256(audited).hexdigest()
            expected = {"notes.txt": AuditedFile("notes.txt", len(audited), sha, "meta.json")}
            [checked], found = verify_commit(
                target, commit, expected, remote, frozenset(), StagedXetHashes(Path("."), expected)
            )
            assert (checked.storage, checked.checked_by, checked.ok, found) == (
                Storage.REGULAR,
                "downloaded bytes",
                not problems,
                problems,
            ), audited


def test_a_commit_is_verified_to_hold_exactly_the_stage_and_the_files_it_keeps():
    """What landed is compared with the stage as a whole: a staged file the commit lacks and a
    file in the commit the stage does not hold are each a problem, while a file the publish keeps
    (the Hub's .gitattributes) is not; every staged file present is checked."""
    from huggingface_hub import HfApi

    from pipeline.publishing.client import Target
    from pipeline.publishing.verify import verify_commit
    from pipeline.publishing.xet import StagedXetHashes

    sha = "a" * 64
    expected = {
        name: AuditedFile(name, 4, sha, "MANIFEST.sha256")
        for name in ("modelo.safetensors", "extra.safetensors")
    }
    unreachable = "http://127.0.0.1:9"  # LFS files are checked by their records: no request is made
    listed = {
        "modelo.safetensors": RemoteFile("modelo.safetensors", 4, "b" * 40, sha),
        "stray.safetensors": RemoteFile("stray.safetensors", 4, "c" * 40, sha),
        ".gitattributes": RemoteFile(".gitattributes", 10, "d" * 40),
    }
    with Deadline(10).installed() as limit:
        target = Target(HfApi(endpoint=unreachable), unreachable, "alice/exact", "main", "", None, limit)
        checked, problems = verify_commit(
            target,
            "e" * 40,
            expected,
            listed,
            frozenset({".gitattributes"}),
            StagedXetHashes(Path("."), expected),
        )
    assert [(f.path_in_repo, f.ok) for f in checked] == [("modelo.safetensors", True)]
    assert problems == [
        "stray.safetensors is in the commit but not in the stage",
        "extra.safetensors is missing from the commit",
    ]


def test_a_xet_hash_of_part_of_the_audited_bytes_is_no_hash(tmp_path, monkeypatch):
    """When hf_xet stops reading the audit's pipe before the last chunk (here: another writer fed
    it the first chunk and closed, so hf_xet saw its end), the hash it took of that part is not the
    file's: the digest gives None. Fed every chunk, it gives the file's Xet hash."""
    import errno
    import tempfile

    import hf_xet

    first, rest = os.urandom(3000), os.urandom(5000)
    (tmp_path / "whole").write_bytes(first + rest)
    [whole] = [info.hash for info in hf_xet.hash_files([str(tmp_path / "whole")])]
    complete = XetDigest()
    complete.update(first)
    complete.update(rest)
    assert complete.hexdigest() == whole

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the digest's pipe is made
    cut = XetDigest()
    [pipe] = tmp_path.glob("xet-hash-*/bytes")
    writer = os.open(pipe, os.O_WRONLY)  # returns once hf_xet has opened the pipe to read
    os.write(writer, first)
    os.close(writer)
    while True:  # until hf_xet has read to the end and closed the pipe
        try:
            os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:
            assert exc.errno == errno.ENXIO, exc
            break
    cut.update(rest)
    assert cut.hexdigest() is None
    assert list(tmp_path.glob("xet-hash-*")) == []


def test_hub_storing_other_bytes_of_the_same_size_for_the_lfs_weights_fails_verification(
    staged_run, hub, tmp_path, token_env
):
    hub.store_other_lfs_bytes()  # the first LFS file of the next commit: modelo.safetensors
    with pytest.raises(VerificationFailed) as failed:
        publish_here(staged_run.stage, hub, "alice/lost-bytes", tmp_path)
    assert failed.value.exit_code == 1 and "modelo.safetensors" in str(failed.value)
    [receipt] = list((tmp_path / "receipts").glob("*.json"))
    record = json.loads(receipt.read_text())
    weights = record["files"]["modelo.safetensors"]
    assert record["verified"] is False and weights["storage"] == "lfs" and not weights["ok"]
    assert [name for name, entry in record["files"].items() if not entry["ok"]] == ["modelo.safetensors"]
    listed = {f.path: f for f in api_for(hub).list_repo_tree("alice/lost-bytes") if hasattr(f, "blob_id")}
    assert listed["modelo.safetensors"].size == weights["size"]  # same size, other bytes


@pytest.mark.parametrize("edit", ["plain", "mtime-put-back", "removed", "while-a-503-is-retried"])
def test_same_size_edit_between_the_audit_and_the_commit_stops_the_publish_with_nothing_committed(
    staged_run, run_copy, hub, tmp_path, token_env, monkeypatch, edit
):
    """Every commit attempt checks the stage first: an edit before the first one, or while 06
    waits to retry a commit the Hub answered 503, is refused before anything is committed."""
    stage = run_copy(staged_run).stage
    mtime_put_back = edit == "mtime-put-back"

    def edit_the_card() -> None:
        card = stage / "README.md"
        if edit == "removed":  # not an edit of the same size, but caught by the same check
            card.unlink()
            return
        before = card.stat()
        data = bytearray(card.read_bytes())
        data[-2] ^= 0x01
        card.write_bytes(bytes(data))
        if mtime_put_back:  # what a process hiding its edit does: only the ctime still tells
            os.utime(card, ns=(before.st_atime_ns, before.st_mtime_ns))

    def edit_when_committing(line: str) -> None:
        if line.startswith("committing"):  # said after the audit and the plan, right before the commit
            edit_the_card()

    retried = edit == "while-a-503-is-retried"
    if retried:
        hub.fail_next_commit(times=1, status=503)
        monkeypatch.setattr(Deadline, "sleep", staticmethod(lambda seconds: edit_the_card()))
    with pytest.raises(StageChanged) as changed:
        publish_here(stage, hub, "alice/edited", tmp_path, say=None if retried else edit_when_committing)
    assert str(changed.value) == (
        f"{stage / 'README.md'} changed on disk after it was audited; nothing was committed; "
        "rebuild the stage with python scripts/05_stage.py, then rerun"
    )
    assert not [title for title in commit_titles(hub, "alice/edited") if title.startswith("Publish")]
    assert hub.count("POST", r"/commit/") == (1 if retried else 0)  # the one answered 503
