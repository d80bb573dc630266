"""localhub against the REAL huggingface_hub client (no client mocking).

The client runs on its legacy LFS path (HF_HUB_DISABLE_XET=1), offline mode off, telemetry off (telemetry would
try to reach huggingface.co to detect "agent harnesses"), a temporary HF_HOME and no implicit token. Because
huggingface_hub reads these settings into `huggingface_hub.constants` at import time, the `hf_env` fixture
patches both the environment and the constants, whatever the import order of the test session.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import httpx2
import pytest
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    constants,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.lfs import UploadInfo, post_lfs_batch_info
from huggingface_hub.utils import _http as hf_http
from huggingface_hub.utils._runtime import is_xet_available

from localhub import LocalHub, LocalHubProcess, admin_request, check_loopback

# The client's LFS PUT passes a file object as `data=`, which httpx2 flags; nothing to fix on our side.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

TOKEN = "test-token-5f1c"
REPO = "alice/model"
PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONFIG = b'{"hidden_size": 8}\n'


def _weights() -> bytes:
    """A real safetensors file of a few KB (falls back to arbitrary binary bytes)."""
    try:
        import numpy as np
        from safetensors.numpy import save

        return save({"w": np.arange(1024, dtype=np.float32)})
    except ImportError:
        return bytes(range(256)) * 16


WEIGHTS = _weights()


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture(autouse=True)
def hf_env(tmp_path, monkeypatch):
    hf_home = tmp_path / "hf_home"
    for key, value in {
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": str(hf_home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
    }.items():
        monkeypatch.setenv(key, value)
    for key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_CACHE", "LOCALHUB_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    for name, value in {
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": True,
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens"),
    }.items():
        monkeypatch.setattr(constants, name, value)


@pytest.fixture
def hub(tmp_path):
    with LocalHub(tmp_path / "hub", token=TOKEN) as server:
        yield server


@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub.url, token=TOKEN)


@pytest.fixture
def repo(api, hub):
    api.create_repo(REPO)
    hub.reset_request_counts()
    return REPO


def _ops(config: bytes = CONFIG, weights: bytes = WEIGHTS) -> list[CommitOperationAdd]:
    return [CommitOperationAdd("config.json", config), CommitOperationAdd("model.safetensors", weights)]


def _commit_ids(api: HfApi, repo_id: str = REPO, **kwargs) -> list[str]:
    return [c.commit_id for c in api.list_repo_commits(repo_id, **kwargs)]


def _download(hub, tmp_path, filename, **kwargs) -> bytes:
    kwargs.setdefault("token", TOKEN)
    path = hf_hub_download(
        kwargs.pop("repo_id", REPO), filename, endpoint=hub.url, cache_dir=tmp_path / "cache", **kwargs
    )
    return Path(path).read_bytes()


def test_client_runs_on_the_legacy_lfs_path():
    # hf_xet is installed in the venv: without the fixture the client would try the Xet protocol.
    assert not is_xet_available()


def test_create_repo_makes_initial_commit_and_honours_exist_ok(api, hub, tmp_path):
    url = api.create_repo(REPO)
    assert (url.repo_id, url.endpoint) == (REPO, hub.url)
    [initial] = api.list_repo_commits(REPO)
    assert (initial.title, initial.authors) == ("initial commit", ["system"])
    assert re.fullmatch(r"[0-9a-f]{40}", initial.commit_id)
    assert api.list_repo_files(REPO) == [".gitattributes"]
    assert b"*.safetensors filter=lfs" in _download(hub, tmp_path, ".gitattributes")

    assert api.create_repo(REPO, exist_ok=True) == url  # 409 handled by the client
    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo(REPO)
    assert err.value.response.status_code == 409
    assert _commit_ids(api) == [initial.commit_id]
    assert api.whoami()["name"] == "localhub"


def test_commit_regular_and_lfs_files_round_trip(api, hub, repo, tmp_path):
    info = api.create_commit(repo, _ops(), commit_message="add model")

    commits = api.list_repo_commits(repo)
    assert len(commits) == 2 and commits[0].commit_id == info.oid and commits[0].title == "add model"
    assert hub.count("POST", r"/commit/main$") == 1
    assert hub.count("PUT", r"^/_localhub/lfs/") == 1 and hub.count("POST", r"/lfs-verify/") == 1

    paths = {p.path: p for p in api.get_paths_info(repo, ["config.json", "model.safetensors", "missing"])}
    assert set(paths) == {"config.json", "model.safetensors"}
    assert paths["model.safetensors"].lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert paths["model.safetensors"].lfs.size == paths["model.safetensors"].size == len(WEIGHTS)
    assert paths["config.json"].lfs is None and paths["config.json"].blob_id == git_blob_sha1(CONFIG)
    tree = {f.path: f for f in api.list_repo_tree(repo, recursive=True)}
    assert tree["model.safetensors"].lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()

    assert _download(hub, tmp_path, "model.safetensors") == WEIGHTS
    assert _download(hub, tmp_path, "config.json") == CONFIG
    snapshot = Path(snapshot_download(repo, endpoint=hub.url, token=TOKEN, cache_dir=tmp_path / "snap"))
    assert (snapshot / "model.safetensors").read_bytes() == WEIGHTS
    assert sorted(p.name for p in snapshot.iterdir()) == [
        ".gitattributes",
        "config.json",
        "model.safetensors",
    ]
    assert api.model_info(repo, files_metadata=True).sha == info.oid
    assert api.list_repo_refs(repo).branches[0].target_commit == info.oid
    assert api.file_exists(repo, "config.json") and not api.file_exists(repo, "nope.json")


def test_damaged_stored_object_is_a_server_error_not_a_hang(api, hub, repo):
    """Plain HTTP, so the client's own retries of a 500 do not slow the test down."""
    import urllib.error
    import urllib.request

    api.create_commit(repo, _ops(), commit_message="add model")
    hub.store.object_path(hashlib.sha256(WEIGHTS).hexdigest()).write_bytes(WEIGHTS[:100])
    request = urllib.request.Request(
        f"{hub.url}/{repo}/resolve/main/model.safetensors", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=10)
    assert error.value.code == 500 and "damaged" in error.value.headers.get("X-Error-Message", "")


def test_rerun_skips_uploaded_blobs_and_unchanged_files(api, hub, repo):
    first = api.create_commit(repo, _ops(), commit_message="add model")
    hub.reset_request_counts()
    # Same content again: preupload reports the remote oids, so the client makes no commit at all.
    again = api.create_commit(repo, _ops(), commit_message="add model again")
    assert again.oid == first.oid and hub.count("POST", "/commit/") == 0 and hub.count("PUT") == 0
    # Only the config changed: the LFS batch answers "already stored" for the weights (no PUT).
    api.create_commit(repo, _ops(config=b'{"hidden_size": 16}\n'), commit_message="bigger")
    assert hub.count("PUT") == 0 and hub.count("POST", "/commit/") == 1
    assert len(_commit_ids(api)) == 3


def test_range_requests_are_served(hub, api, repo):
    api.create_commit(repo, _ops(), commit_message="add model")
    request = urllib.request.Request(
        f"{hub.url}/{repo}/resolve/main/model.safetensors", headers={"Range": "bytes=10-19"}
    )
    with urllib.request.urlopen(request) as response:
        assert response.status == 206 and response.read() == WEIGHTS[10:20]
        assert response.headers["Content-Range"] == f"bytes 10-19/{len(WEIGHTS)}"
        assert response.headers["X-Linked-Etag"].strip('"') == hashlib.sha256(WEIGHTS).hexdigest()


def test_wrong_or_missing_token_is_rejected_and_nothing_is_committed(hub, repo):
    for token, message in (("wrong-token", "Invalid credentials"), (False, "must be authenticated")):
        with pytest.raises(HfHubHTTPError, match=message) as err:
            HfApi(endpoint=hub.url, token=token).create_commit(repo, _ops(), commit_message="sneaky")
        assert err.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as err:
        HfApi(endpoint=hub.url, token="wrong-token").whoami()
    assert err.value.response.status_code == 401
    assert hub.count("POST", "/commit/") == 0 and hub.count("PUT") == 0
    assert len(_commit_ids(HfApi(endpoint=hub.url, token=TOKEN))) == 1


def test_private_repo_is_invisible_without_token(api, hub, tmp_path):
    api.create_repo("alice/secret", private=True)
    api.upload_file(path_or_fileobj=CONFIG, path_in_repo="config.json", repo_id="alice/secret")
    anonymous = HfApi(endpoint=hub.url, token=False)
    with pytest.raises(RepositoryNotFoundError):
        anonymous.model_info("alice/secret")
    with pytest.raises(RepositoryNotFoundError):
        _download(hub, tmp_path, "config.json", repo_id="alice/secret", token=False)
    assert not anonymous.file_exists("alice/secret", "config.json")
    assert api.model_info("alice/secret").private is True
    assert _download(hub, tmp_path, "config.json", repo_id="alice/secret") == CONFIG


def test_missing_repo_revision_and_entry_raise_the_client_errors(api, hub, repo, tmp_path):
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("alice/does-not-exist")
    with pytest.raises(RevisionNotFoundError):
        api.model_info(repo, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        _download(hub, tmp_path, ".gitattributes", revision="no-such-branch")
    with pytest.raises(RemoteEntryNotFoundError):
        _download(hub, tmp_path, "missing.bin")
    with pytest.raises(RemoteEntryNotFoundError):
        list(api.list_repo_tree(repo, path_in_repo="no-folder"))
    with pytest.raises(RemoteEntryNotFoundError):
        api.delete_file("missing.bin", repo)


def test_stale_parent_commit_is_refused_with_412(api, hub, repo, tmp_path):
    [initial] = _commit_ids(api)
    first = api.create_commit(
        repo, [CommitOperationAdd("a.txt", b"one")], commit_message="one", parent_commit=initial
    )
    with pytest.raises(HfHubHTTPError) as err:
        api.create_commit(
            repo, [CommitOperationAdd("a.txt", b"two")], commit_message="two", parent_commit=initial
        )
    assert err.value.response.status_code == 412
    assert _commit_ids(api) == [first.oid, initial]
    assert _download(hub, tmp_path, "a.txt") == b"one"


def test_injected_500_on_commit_writes_nothing(api, hub, repo):
    hub.fail_next_commit()
    with pytest.raises(HfHubHTTPError) as err:
        api.create_commit(repo, _ops(), commit_message="doomed")
    assert err.value.response.status_code == 500
    assert hub.count("POST", "/commit/") == 1  # create_commit does not retry the commit call itself
    assert len(_commit_ids(api)) == 1 and not api.file_exists(repo, "config.json")
    api.create_commit(repo, _ops(), commit_message="works")
    assert len(_commit_ids(api)) == 2


def test_injected_429_with_retry_after(api, hub, repo):
    # On preupload (sent through http_backoff) the client sleeps Retry-After + 1 s, then retries by itself.
    hub.rate_limit_next(times=1, retry_after=0, method="POST", path=r"/preupload/")
    started = time.monotonic()
    api.create_commit(repo, _ops(), commit_message="after a 429")
    assert time.monotonic() - started >= 1.0
    assert hub.count("POST", r"/preupload/") == 2 and len(_commit_ids(api)) == 2

    # On the commit call (plain POST, no backoff) the 429 surfaces; the next request goes through.
    hub.rate_limit_next(times=1, retry_after=7, method="POST", path=r"/commit/")
    with pytest.raises(HfHubHTTPError) as err:
        api.create_commit(repo, [CommitOperationAdd("b.txt", b"b")], commit_message="limited")
    assert err.value.response.status_code == 429 and err.value.response.headers["Retry-After"] == "7"
    assert len(_commit_ids(api)) == 2
    api.create_commit(repo, [CommitOperationAdd("b.txt", b"b")], commit_message="b")
    assert len(_commit_ids(api)) == 3


def test_one_dropped_upload_is_retried_by_the_client(api, hub, repo):
    hub.drop_next_upload()
    api.create_commit(repo, _ops(), commit_message="survives a drop")
    assert hub.count("PUT") == 2 and hub.count("POST", "/commit/") == 1
    assert len(_commit_ids(api)) == 2


def test_dropped_uploads_beyond_retries_fail_cleanly_then_rerun_lands_once(api, hub, repo, monkeypatch):
    sleeps: list[float] = []
    # Only the client's backoff clock is replaced (it would sleep 23 s); every HTTP exchange is real.
    monkeypatch.setattr(hf_http, "time", SimpleNamespace(sleep=sleeps.append))
    hub.drop_next_upload(times=6)  # the first try + 5 retries of http_backoff
    with pytest.raises(RuntimeError, match="Error while uploading 'model.safetensors'") as err:
        api.create_commit(repo, _ops(), commit_message="never lands")
    assert isinstance(err.value.__cause__, httpx2.TransportError)
    assert sleeps == [1, 2, 4, 8, 8] and hub.count("PUT") == 6
    assert hub.count("POST", "/commit/") == 0 and len(_commit_ids(api)) == 1
    assert not hub.store.has_object(hashlib.sha256(WEIGHTS).hexdigest())

    api.create_commit(repo, _ops(), commit_message="lands")
    assert hub.count("POST", "/commit/") == 1 and len(_commit_ids(api)) == 2
    [info] = api.get_paths_info(repo, ["model.safetensors"])
    assert info.lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()


def test_commit_referencing_a_missing_lfs_object_is_rejected_whole(api, hub, repo):
    ghost = CommitOperationAdd("model.safetensors", WEIGHTS)
    ghost._upload_mode, ghost._is_uploaded = "lfs", True  # the client believes it was uploaded: skips the PUT
    with pytest.raises(HfHubHTTPError) as err:
        api.create_commit(repo, [CommitOperationAdd("notes.txt", b"hi"), ghost], commit_message="ghost")
    assert err.value.response.status_code == 422 and "does not exist" in str(err.value)
    assert hub.count("PUT") == 0 and len(_commit_ids(api)) == 1
    assert api.list_repo_files(repo) == [".gitattributes"]


def test_lfs_put_checks_signature_and_content(hub, repo):
    upload = UploadInfo.from_bytes(WEIGHTS)
    [action], errors, _ = post_lfs_batch_info(
        upload_infos=[upload], token=TOKEN, repo_type="model", repo_id=repo, endpoint=hub.url
    )
    href = action["actions"]["upload"]["href"]

    def put(url: str, body: bytes) -> int:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=body, method="PUT")) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert not errors
    assert put(href, bytes(len(WEIGHTS))) == 400  # right size, wrong sha256
    assert put(href.replace("sig=", "sig=0"), WEIGHTS) == 403
    assert not hub.store.has_object(upload.sha256.hex())
    assert put(href, WEIGHTS) == 200
    [again], _, _ = post_lfs_batch_info(
        upload_infos=[upload], token=TOKEN, repo_type="model", repo_id=repo, endpoint=hub.url
    )
    assert "actions" not in again  # already stored: a rerun uploads nothing


def test_admin_endpoint_drives_faults_and_reports_counts(api, hub, repo):
    with pytest.raises(urllib.error.HTTPError) as err:
        admin_request(hub.url, "wrong-token", "GET", "/_localhub/faults")
    assert err.value.code == 401
    pending = admin_request(hub.url, TOKEN, "POST", "/_localhub/faults", {"fail_commit": {"times": 1}})
    assert pending["fail_commit"] == [500]
    with pytest.raises(HfHubHTTPError):
        api.create_commit(repo, _ops(), commit_message="doomed")
    counts = admin_request(hub.url, TOKEN, "GET", "/_localhub/requests")["counts"]
    assert counts[f"POST /api/models/{repo}/commit/main"] == 1
    assert admin_request(hub.url, TOKEN, "DELETE", "/_localhub/requests")["total"] == 0


def test_branches_and_deletions(api, hub, repo, tmp_path):
    api.create_branch(repo, branch="dev")
    api.create_branch(repo, branch="dev", exist_ok=True)
    api.create_commit(
        repo,
        [
            CommitOperationAdd("a/x.txt", b"x"),
            CommitOperationAdd("a/y.txt", b"y"),
            CommitOperationAdd("b.txt", b"b"),
        ],
        commit_message="on dev",
        revision="dev",
    )
    refs = {b.name: b.target_commit for b in api.list_repo_refs(repo).branches}
    assert set(refs) == {"main", "dev"} and refs["main"] != refs["dev"]
    assert len(_commit_ids(api, revision="dev")) == 2 and len(_commit_ids(api)) == 1
    assert _download(hub, tmp_path, "a/x.txt", revision="dev") == b"x"
    assert not api.file_exists(repo, "b.txt")

    api.create_commit(
        repo,
        [CommitOperationDelete("a/"), CommitOperationDelete("b.txt")],
        commit_message="clean",
        revision="dev",
    )
    assert api.list_repo_files(repo, revision="dev") == [".gitattributes"]


def test_subprocess_server_prints_url_persists_and_stops_cleanly(tmp_path):
    root, log = tmp_path / "state", tmp_path / "stderr.log"
    with open(log, "w") as stderr:
        server = LocalHubProcess(root, token=TOKEN, stderr=stderr).start()
        try:
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+", server.url)
            assert TOKEN not in " ".join(server.proc.args)  # the token travels through the environment
            api = HfApi(endpoint=server.url, token=TOKEN)
            api.create_repo(REPO)
            info = api.create_commit(REPO, _ops(), commit_message="add model")
            server.set_faults(fail_commit={"times": 1})
            with pytest.raises(HfHubHTTPError):
                api.create_commit(REPO, [CommitOperationAdd("c.txt", b"c")], commit_message="doomed")
            assert server.request_counts()[f"POST /api/models/{REPO}/commit/main"] == 2
        finally:
            assert server.stop() == 0

        restarted = LocalHubProcess(root, token=TOKEN, stderr=stderr).start()
        try:
            api = HfApi(endpoint=restarted.url, token=TOKEN)
            assert _commit_ids(api)[0] == info.oid and len(_commit_ids(api)) == 2
            path = hf_hub_download(
                REPO, "model.safetensors", endpoint=restarted.url, token=TOKEN, cache_dir=tmp_path / "cache"
            )
            assert Path(path).read_bytes() == WEIGHTS
        finally:
            assert restarted.stop() == 0
    assert TOKEN not in log.read_text()


def test_in_process_restart_keeps_state_and_one_root_has_one_server(tmp_path):
    with LocalHub(tmp_path / "hub", token=TOKEN) as first:
        api = HfApi(endpoint=first.url, token=TOKEN)
        api.create_repo(REPO)
        info = api.create_commit(REPO, _ops(), commit_message="add model")
        with pytest.raises(RuntimeError, match="already serving"):
            LocalHub(tmp_path / "hub", token=TOKEN)
    with LocalHub(tmp_path / "hub", token=TOKEN) as second:
        assert _commit_ids(HfApi(endpoint=second.url, token=TOKEN))[0] == info.oid
        assert _download(second, tmp_path, "model.safetensors") == WEIGHTS


def test_non_loopback_host_is_refused(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    for host in ("0.0.0.0", "192.168.1.10", "example.com"):
        result = subprocess.run(
            [sys.executable, "-m", "localhub", "--root", str(tmp_path), "--host", host],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert result.returncode == 2 and result.stdout == ""
        assert len(result.stderr.strip().splitlines()) == 1 and "loopback" in result.stderr
    with pytest.raises(ValueError):
        LocalHub(tmp_path, host="0.0.0.0")
    assert check_loopback("::1") == "::1" and check_loopback("localhost") == "localhost"


# -- Xet (the client's default path; the publish tests cover uploads, faults and verification) ----------------


def test_xet_stored_file_is_served_rebuilt_by_any_byte_range_and_the_cas_checks_token_scopes(
    hub, api, repo, monkeypatch
):
    monkeypatch.delenv("HF_HUB_DISABLE_XET", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    data = os.urandom(300_000) + bytes(200_000)  # random, then zeros: several chunks of different sizes
    api.create_commit(REPO, [CommitOperationAdd("w.safetensors", data)], commit_message="over xet")
    assert hub.count("POST", r"/v1/xorbs/") >= 1 and hub.count("PUT") == 0
    [entry] = api.get_paths_info(REPO, ["w.safetensors"], expand=True)
    assert entry.xet_hash is not None and entry.lfs.sha256 == hashlib.sha256(data).hexdigest()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # A client without Xet gets the bytes rebuilt from the CAS, whole or any range of them.
    for first, last in ((0, len(data) - 1), (70_000, 270_123), (len(data) - 10, len(data) - 1)):
        answer = httpx2.get(
            f"{hub.url}/{REPO}/resolve/main/w.safetensors", headers={**auth, "Range": f"bytes={first}-{last}"}
        )
        assert answer.content == data[first : last + 1] and answer.headers["X-Xet-Hash"] == entry.xet_hash
    # The reconstruction of a range starts in the chunk holding its first byte.
    grant = httpx2.get(f"{hub.url}/api/models/{REPO}/xet-read-token/main", headers=auth).json()
    read = {"Authorization": f"Bearer {grant['accessToken']}"}
    plan = httpx2.get(
        f"{grant['casUrl']}/v1/reconstructions/{entry.xet_hash}",
        headers={**read, "Range": "bytes=70000-270123"},
    ).json()
    covered = sum(term["unpacked_length"] for term in plan["terms"])
    assert 0 < plan["offset_into_first_range"] < plan["terms"][0]["unpacked_length"]
    assert covered - plan["offset_into_first_range"] >= 200_124 and covered < len(data)
    # A read token cannot write, no token cannot read; a private repo's read token needs the Hub token.
    assert httpx2.post(f"{grant['casUrl']}/v1/shards", content=b"x", headers=read).status_code == 403
    assert httpx2.get(f"{grant['casUrl']}/v1/reconstructions/{entry.xet_hash}").status_code == 401
    api.create_repo("alice/secret", private=True)
    assert httpx2.get(f"{hub.url}/api/models/alice/secret/xet-read-token/main").status_code == 404
