"""06 within its --timeout: one deadline over the whole publish, the Xet and LFS clients'
retries capped by it, and the idempotent requests (reads, repo creation) retried inside it.

The real scripts as subprocesses where the wall time and the one error line matter (with
the Xet client's own retry settings, not the suite's fast ones: 06's cap must bound them);
publish() in this process where only our own retry waits are at stake (recorded, not slept).
"""

from __future__ import annotations

import time

import pytest
import test_publish
from test_publish import commit_titles, publish_here, run_publish, stored
from test_publish_safety import error_line_after_uploads

from pipeline.errors import PublishError

from support import XET_FAST_RETRIES

hf_env, hub, token_env, waits = (
    test_publish.hf_env,
    test_publish.hub,
    test_publish.token_env,
    test_publish.waits,
)

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

# The Xet client's defaults (5 retries from 3 s, up to 360 s): what a user runs with.
XET_DEFAULTS = {name: None for name in XET_FAST_RETRIES}
XET_READS = r"/reconstructions/|/_xet/data/"


def timed_publish(stage, hub, repo_id, receipts, *args, **kwargs):
    started = time.monotonic()
    result = run_publish(stage, hub, repo_id, receipts, *args, timeout=60, **kwargs)
    return result, time.monotonic() - started


def test_06_stops_within_its_timeout_when_every_xorb_or_shard_upload_fails_and_a_rerun_publishes_once(
    staged_run, hub, tmp_path
):
    receipts, repo = tmp_path / "receipts", "alice/xet-deadline"
    hub.drop_next_xorb(times=100_000)  # every xorb upload is cut mid-body
    dropped, elapsed = timed_publish(
        staged_run.stage, hub, repo, receipts, "--timeout", "10", protocol="xet", env=XET_DEFAULTS
    )
    line = error_line_after_uploads(dropped)
    assert elapsed < 30, elapsed
    assert "the Xet client gave up on the Xet xorb upload" in line and "10s --timeout" in line, line
    assert "nothing was committed" in line and "rerun" in line, line
    assert commit_titles(hub, repo) == ["initial commit"] and stored(hub, "xorbs") == []

    hub.clear_faults()
    hub.fail_next_shard(times=100_000, status=503)  # the data lands, the file's registration never does
    failed, elapsed = timed_publish(
        staged_run.stage, hub, repo, receipts, "--timeout", "10", protocol="xet", env=XET_DEFAULTS
    )
    line = error_line_after_uploads(failed)
    assert elapsed < 30, elapsed
    assert "the Xet shard upload" in line and "503" in line and "nothing was committed" in line, line
    uploaded = stored(hub, "xorbs")
    assert uploaded and stored(hub, "shards") == [] and commit_titles(hub, repo) == ["initial commit"]

    hub.clear_faults()
    hub.reset_request_counts()
    healthy = run_publish(staged_run.stage, hub, repo, receipts, protocol="xet", env=XET_DEFAULTS)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert len(commit_titles(hub, repo)) == 2
    # The CAS already held the data: found through the dedup query, not sent again; verified without reading it back.
    assert hub.count("POST", r"/v1/xorbs/") == 0 and stored(hub, "xorbs") == uploaded
    assert hub.count("GET", XET_READS) == 0


def test_06_stops_within_its_timeout_when_every_lfs_preupload_fails(staged_run, hub, tmp_path):
    hub.rate_limit_next(times=100_000, retry_after=None, method="POST", path=r"/preupload/", status=503)
    result, elapsed = timed_publish(
        staged_run.stage, hub, "alice/lfs-deadline", tmp_path / "receipts", "--timeout", "2"
    )
    line = error_line_after_uploads(result)
    # The client's own backoff between two tries (at most 8 s) may end past the deadline; no try starts after it.
    assert elapsed < 20, elapsed
    assert "ran out of its 2s --timeout while uploading and committing" in line, line
    assert "the preupload request sent" in line and "last error: HTTP 503 to the preupload request" in line, (
        line
    )
    assert "nothing was committed" in line, line
    assert hub.count("POST", r"/commit/") == 0 and commit_titles(hub, "alice/lfs-deadline") == [
        "initial commit"
    ]


def test_a_503_on_the_first_read_and_a_429_on_repo_creation_are_retried_and_a_read_failing_for_good_is_one_line(
    staged_run, hub, tmp_path, token_env, waits
):
    hub.rate_limit_next(
        times=1, retry_after=None, method="GET", path=r"/alice/retried/revision/main$", status=503
    )
    hub.rate_limit_next(times=1, retry_after=3, method="POST", path=r"/api/repos/create$")
    said: list[str] = []
    result = publish_here(staged_run.stage, hub, "alice/retried", tmp_path, say=said.append)
    assert result.status == "published" and waits == [1.0, 3.0], (waits, said)
    assert (
        hub.count("GET", r"/alice/retried/revision/main$") >= 3
        and hub.count("POST", r"/api/repos/create$") == 2
    )
    assert len(commit_titles(hub, "alice/retried")) == 2
    assert any(
        line.startswith("creating the repo: HTTP 429 to the repo creation; retrying in 3s") for line in said
    )

    waits.clear()
    hub.reset_request_counts()
    hub.rate_limit_next(
        times=100, retry_after=None, method="GET", path=r"/alice/down/revision/main$", status=502
    )
    with pytest.raises(PublishError) as refused:
        publish_here(staged_run.stage, hub, "alice/down", tmp_path)
    message = str(refused.value)
    assert "the Hub answered HTTP 502 while reading branch main on alice/down" in message, message
    assert "nothing was committed" in message and waits == [1.0, 2.0, 4.0, 8.0]
    assert hub.count("POST") == 0
