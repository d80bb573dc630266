"""06 within its --timeout: one deadline over the whole publish, the Xet and LFS clients'
retries capped by it, a server that trickles its answers cut off by it, and the idempotent
requests (reads, repo creation) retried inside it.

The real scripts as subprocesses where the wall time and the one error line matter (with
the Xet client's own retry settings, not the suite's fast ones: 06's cap must bound them);
publish() in this process where only our own retry waits are at stake (recorded, not slept).
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import httpx2
import pytest
import test_publish
from huggingface_hub import get_session
from test_publish import assert_holds_exactly_the_stage, commit_titles, publish_here, run_publish, stored
from test_publish_safety import error_line_after_uploads

from pipeline.errors import (
    DeadlinePassed,
    HubUnavailable,
    PublishError,
    PublishTimedOut,
    UploadInterrupted,
    VerificationFailed,
)
from pipeline.publishing import deadline
from pipeline.publishing import xet as xet_side

from support import XET_FAST_RETRIES

hf_env, hub, token_env, waits, xet = (
    test_publish.hf_env,
    test_publish.hub,
    test_publish.token_env,
    test_publish.waits,
    test_publish.xet,
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
    # The branch head was read again before saying so: the commit may have landed despite the failure.
    assert ", and the head of main did not move: nothing was committed; rerun" in line, line
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


# -- a Hub that answers one byte per second (in process: the threads and the client's hooks are ours) --


def client_threads() -> set[threading.Thread]:
    """This process's threads, but the loopback Hub's own (its server and one per connection) and
    tqdm's monitor (one per process, started by the first progress bar that lasts)."""
    others = ("localhub", "tqdm_monitor")
    return {t for t in threading.enumerate() if t.name not in others and "process_request" not in t.name}


def trickled_publish(stage, hub, repo_id, tmp_path, timeout_s, **fields):
    """publish() with ``timeout_s``; returns (the result or the PublishError, seconds, said lines),
    after checking that the publish left no thread and no hook of its deadline behind."""
    threads, hooks = client_threads(), dict(get_session().event_hooks)
    said: list[str] = []
    # Should the deadline not hold, the Hub sends the rest at once after a while: a failure, not a hang.
    release = threading.Timer(2 * timeout_s + 5, hub.clear_faults)
    release.start()
    started = time.monotonic()
    try:
        outcome = publish_here(stage, hub, repo_id, tmp_path, timeout_s=timeout_s, say=said.append, **fields)
    except PublishError as exc:
        outcome = exc
    finally:
        release.cancel()
        release.join()
    elapsed = time.monotonic() - started
    assert client_threads() == threads, "the publish left a thread behind"
    assert dict(get_session().event_hooks) == hooks, "the publish left its deadline's hooks installed"
    return outcome, elapsed, said


def until_over(started: float, timeout_s: float) -> None:
    """Wait until a publish started at ``started`` is past its deadline and its settling time,
    so that anything of it still installed would refuse the next request."""
    time.sleep(max(0.0, started + 2 * timeout_s + 0.2 - time.monotonic()))


def test_a_trickled_lfs_answer_is_cut_at_the_deadline_with_nothing_committed_and_the_next_publish_works(
    staged_run, hub, tmp_path, token_env
):
    hub.trickle_next(method="POST", path=r"/objects/batch$")  # the LFS batch answer, one byte per second
    started = time.monotonic()
    refused, elapsed, _ = trickled_publish(staged_run.stage, hub, "alice/trickle-lfs", tmp_path, 2)
    assert isinstance(refused, PublishTimedOut), refused
    message = str(refused)
    assert "ran out of its 2s --timeout while uploading and committing" in message, message
    assert f"no answer from {hub.url} to the LFS batch request" in message, message
    assert "nothing was committed" in message, message
    # The deadline, then at most the time to read the branch head: no byte-per-second server stretches it.
    assert elapsed < 2 + 2 + 1, elapsed
    assert hub.count("POST", r"/objects/batch$") == 1 and hub.count("POST", r"/commit/") == 0
    assert commit_titles(hub, "alice/trickle-lfs") == ["initial commit"]

    hub.clear_faults()
    until_over(started, 2)
    result = publish_here(staged_run.stage, hub, "alice/trickle-lfs", tmp_path, timeout_s=60)
    assert result.status == "published" and len(commit_titles(hub, "alice/trickle-lfs")) == 2
    assert_holds_exactly_the_stage(hub, "alice/trickle-lfs", staged_run.stage)


def test_a_trickled_answer_to_a_commit_that_landed_is_cut_and_the_commit_found_and_verified(
    staged_run, hub, tmp_path, token_env
):
    hub.trickle_next(method="POST", path=r"/commit/main$")  # the commit lands; its answer trickles
    result, elapsed, said = trickled_publish(staged_run.stage, hub, "alice/trickle-commit", tmp_path, 3)
    assert not isinstance(result, Exception), result
    assert result.status == "published" and result.answer_lost and all(f.ok for f in result.files)
    assert elapsed < 3 + 3 + 1, elapsed
    assert any(
        "ran out of its 3s --timeout while uploading and committing" in line
        and f"no answer from {hub.url} to the commit" in line
        for line in said
    ), said
    assert any("the answer to the commit was lost, but the commit landed" in line for line in said), said
    assert len(commit_titles(hub, "alice/trickle-commit")) == 2 and hub.count("POST", r"/commit/") == 1


def test_a_trickled_xet_shard_answer_is_cut_at_the_deadline_with_nothing_committed_and_the_next_publish_works(
    staged_run, hub, tmp_path, token_env, xet
):
    hub.trickle_next(method="POST", path=r"/shards$")  # the Xet client's shard upload, answered byte by byte
    started = time.monotonic()
    refused, elapsed, _ = trickled_publish(staged_run.stage, hub, "alice/trickle-xet", tmp_path, 4)
    assert isinstance(refused, PublishTimedOut), refused
    message = str(refused)
    assert "ran out of its 4s --timeout while uploading and committing" in message, message
    assert "the Xet upload was still running when the time was up: stopped" in message, message
    assert "nothing was committed" in message, message
    assert elapsed < 4 + 4 + 1, elapsed
    assert hub.count("POST", r"/shards$") == 1 and hub.count("POST", r"/commit/") == 0
    assert stored(hub, "shards") == [] and commit_titles(hub, "alice/trickle-xet") == ["initial commit"]

    hub.clear_faults()
    until_over(started, 4)
    result = publish_here(staged_run.stage, hub, "alice/trickle-xet", tmp_path, timeout_s=60)
    assert result.status == "published" and len(commit_titles(hub, "alice/trickle-xet")) == 2
    assert {f.storage.value for f in result.files} >= {"xet", "regular"}


def test_a_host_that_does_not_resolve_is_one_line_at_once_without_retries(
    staged_run, tmp_path, token_env, waits
):
    started = time.monotonic()
    with pytest.raises(PublishError) as refused:
        publish_here(
            staged_run.stage, SimpleNamespace(url="http://no-such-host.invalid"), "alice/x", tmp_path
        )
    message = str(refused.value)
    assert (
        "the host no-such-host.invalid of the endpoint http://no-such-host.invalid cannot be resolved"
        in message
    )
    assert "check --endpoint / HF_ENDPOINT" in message and "nothing was committed" in message, message
    assert waits == [] and time.monotonic() - started < 10


def test_a_silent_server_is_given_up_on_after_the_longest_wait_for_one_answer_and_retried_within_the_deadline(
    staged_run, tmp_path, token_env, waits, monkeypatch
):
    """Well before the deadline, a request that gets no answer within REQUEST_TIMEOUT_S (60 s,
    shortened here) is abandoned and, being a read, retried: the deadline alone would wait."""
    import socket

    monkeypatch.setattr(deadline, "REQUEST_TIMEOUT_S", 0.5)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # the kernel completes the handshakes; nobody ever reads or replies
    silent = SimpleNamespace(url=f"http://127.0.0.1:{listener.getsockname()[1]}")
    try:
        with pytest.raises(UploadInterrupted) as refused:
            publish_here(staged_run.stage, silent, "alice/silent", tmp_path, timeout_s=30)
    finally:
        listener.close()
    # Five tries of 0.5 s each, the waits between them recorded, not slept: far from the deadline.
    message = str(refused.value)
    assert f"no answer from {silent.url} to reading the branch head within 0.5s" in message, message
    assert "nothing was committed" in message and waits == [1.0, 2.0, 4.0, 8.0], (waits, message)


def test_after_the_first_cut_the_settled_deadline_still_cuts_a_verification_that_hangs(
    staged_run, hub, tmp_path, token_env
):
    """The commit lands but its answer trickles: the watchdog cuts it at the deadline (its
    first cut), the publish settles (finding the commit, verifying it) within ``min(timeout,
    SETTLE_S)`` more, and the watchdog must cut again when that passes: here every download
    of the check after landing trickles too. Without the second cut the verification would
    hang until the server stops (here the test's release, at 2 x timeout + 5 s)."""
    hub.trickle_next(method="POST", path=r"/commit/main$")
    hub.trickle_next(times=100, method="GET", path=r"/resolve/")  # the small files' downloads
    result, elapsed, said = trickled_publish(staged_run.stage, hub, "alice/trickle-settled", tmp_path, 3)
    assert any("the answer to the commit was lost, but the commit landed" in line for line in said), said
    assert isinstance(result, VerificationFailed), result
    message = str(result)
    assert message.startswith("could not verify what landed: "), message
    assert "ran out of its 3s --timeout while verifying" in message and "rerun to verify" in message, message
    assert hub.count("GET", r"/resolve/") >= 1 and hub.count("POST", r"/commit/") == 1
    # Cut at the settled deadline, 3 + 3 s: well before the release would end the trickle.
    assert elapsed < 3 + 3 + 2, elapsed


# -- the deadline's own rules, on a real clock (the time left, not the --timeout, is what counts) --


def test_a_retry_that_would_wait_past_the_time_left_stops_at_once(waits):
    limit = deadline.Deadline(1.0)
    limit.wait(0.1, "reading the branch head")  # within the time left: waited
    time.sleep(0.5)
    with pytest.raises(DeadlinePassed, match="no time left to retry the commit"):
        limit.wait(0.6, "the commit")  # shorter than the --timeout, longer than what is left
    assert waits == [0.1]


def test_a_retry_after_longer_than_the_time_left_ends_the_request_at_once(hub):
    path = r"/api/models/alice/asked$"
    hub.rate_limit_next(times=2, retry_after=1, method="GET", path=path)
    url = f"{hub.url}/api/models/alice/asked"
    with deadline.Deadline(10).installed():  # a 1 s wait fits: the answer is the client's to retry
        assert get_session().get(url).status_code == 429
    limit = deadline.Deadline(1.5)
    time.sleep(0.6)  # 0.9 s left, less than the 1 s asked (though the --timeout is longer)
    with limit.installed(), pytest.raises(DeadlinePassed, match="asks to wait 1s before retrying") as asked:
        get_session().get(url)
    assert asked.value.asked == 1


def test_a_negative_or_nan_retry_after_is_a_retry_at_once_not_a_negative_sleep(hub, waits):
    # Retry-After is a number of seconds to wait (or a date); a server sending "-5" or "nan"
    # asks for no wait at all: the retry goes at once (time.sleep(-5) would raise ValueError).
    path = r"/api/models/alice/negative$"
    hub.rate_limit_next(times=1, retry_after=-5, method="GET", path=path)
    answer = get_session().get(f"{hub.url}/api/models/alice/negative")
    assert answer.status_code == 429 and answer.headers["Retry-After"] == "-5"
    asked = [deadline.retry_after_s(answer.headers)]
    asked += [deadline.retry_after_s(type(answer.headers)({"Retry-After": raw})) for raw in ("nan", "-inf")]
    assert asked == [0.0, 0.0, 0.0]
    limit = deadline.Deadline(10)
    for wait in asked:
        limit.wait(wait, "the commit")
    assert waits == [0.0, 0.0, 0.0]


def test_a_xet_upload_that_finished_is_not_stopped_or_named_when_the_time_is_up_later(clock):
    """Only what still runs when the time is up is stopped and named in the timeout's last error:
    a Xet upload that ended before (the commit then sent and being verified) is stopped once,
    with the publish."""
    stopped: list[str] = []
    limit = deadline.Deadline(10)
    with limit.installed():
        with limit.stopping("the Xet upload", lambda: stopped.append("the Xet upload")):
            pass
        cut = threading.Event()
        with limit.stopping("a later upload", cut.set):
            clock[0] += 30  # past the deadline and past all that settling can grant
            limit.settle()  # the commit was sent: the watchdog looks at the time again
            assert cut.wait(60), "the watchdog never cut at the deadline"
        assert stopped == []
        assert limit.why("verifying", DeadlinePassed("verifying was not sent")) == (
            "publishing ran out of its 10s --timeout while verifying; last error: "
            "a later upload was still running when the time was up: stopped"
        )
    assert stopped == ["the Xet upload"]


def test_settling_after_the_commit_never_runs_past_the_timeout_and_one_settling_time():
    started = time.monotonic()
    limit = deadline.Deadline(0.2)
    made = time.monotonic()
    time.sleep(0.3)  # past the deadline: the commit was sent, its outcome is being found out
    limit.settle()
    assert started + 0.3 < limit.end <= made + 0.2 + 0.2, (limit.end - started, made - started)
    time.sleep(max(0.0, limit.end - time.monotonic()) + 0.05)
    limit.settle()  # a second settle (the verification) gets no more time
    assert limit.expired(), limit.remaining()


def test_settling_keeps_the_time_a_publish_still_has_when_that_is_more_than_the_settling_time():
    """--timeout bounds the whole publish (docs/publishing.md): settling only grants min(S, 30) s
    more when less is left. A commit answered with ten minutes left keeps them to verify."""
    limit = deadline.Deadline(600)
    limit.settle()
    assert limit.remaining() > 590, limit.remaining()


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The deadline's clock, set by the test: ``clock[0]`` is now, in seconds."""
    now = [1000.0]
    monkeypatch.setattr(deadline, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_a_publish_past_its_deadline_gets_thirty_seconds_to_settle_or_its_whole_timeout_when_shorter(clock):
    """docs/publishing.md: once the commit was sent, min(--timeout, 30 s) more to find out whether
    it landed and verify it, never past --timeout + min(--timeout, 30 s)."""
    for timeout, settling in ((100, 30), (30, 30), (5, 5)):
        clock[0] = 1000.0
        limit = deadline.Deadline(timeout)
        clock[0] += timeout  # the whole --timeout spent uploading
        assert limit.expired()
        limit.settle()
        assert limit.remaining() == settling, timeout
        clock[0] += settling / 2
        limit.settle()  # settling again (the verification) grants nothing more
        assert limit.remaining() == settling / 2, timeout


def test_a_retry_is_waited_only_while_it_ends_before_the_deadline(clock, waits):
    limit = deadline.Deadline(10)
    clock[0] += 9.5
    assert not limit.expired() and limit.remaining() == 0.5
    limit.wait(0.25, "the commit")
    with pytest.raises(DeadlinePassed, match="no time left to retry the commit"):
        limit.wait(0.5, "the commit")  # it would end exactly at the deadline: no time left to send it
    assert waits == [0.25]
    clock[0] += 0.5
    assert limit.expired() and limit.remaining() == 0


def test_a_commit_answered_500_when_less_than_its_backoff_is_left_gives_up_naming_the_timeout(
    staged_run, hub, tmp_path, token_env, waits, clock
):
    """No Retry-After: the backoff (1 s) is the wait; with half a second left when the 500
    comes, the commit is not retried, and the line names the --timeout, not the time left."""

    def say(line: str) -> None:
        if line.startswith("committing "):
            clock[0] += 59.5  # the audit and the upload took all but half a second of 60

    hub.fail_next_commit(times=1, status=500)
    with pytest.raises(HubUnavailable) as refused:
        publish_here(staged_run.stage, hub, "alice/late", tmp_path, timeout_s=60, say=say)
    assert str(refused.value) == (
        "the Hub answered HTTP 500 to the commit on alice/late and a retry after 1s would be past the "
        "60s --timeout; nothing was committed; rerun later (uploaded blobs are kept)"
    )
    assert waits == [] and commit_titles(hub, "alice/late") == ["initial commit"]


def test_the_default_timeout_is_five_minutes_plus_one_second_per_mb_staged():
    """docs/publishing.md: "5 minutes plus 1 second per MB staged, e.g. about 22 minutes for a
    1 GB stage"."""
    assert deadline.default_timeout(0) == 5 * 60
    assert deadline.default_timeout(10**9) == 5 * 60 + 1000
    assert round(deadline.default_timeout(10**9) / 60) == 22
    assert deadline.default_timeout(20 * 10**9) == 5 * 60 + 20_000  # 20 GB: 20,000 MB at 1 s each


XET_SETTINGS = (
    "HF_XET_CLIENT_RETRY_MAX_DURATION",
    "HF_XET_CLIENT_RETRY_BASE_DELAY",
    "HF_XET_CLIENT_READ_TIMEOUT",
    "HF_XET_CLIENT_CONNECT_TIMEOUT",
)


def test_an_xet_upload_after_a_slow_start_has_hf_xets_settings_capped_by_the_time_left(xet, monkeypatch):
    """upload_within caps hf_xet's retry budget and timeouts by what the deadline has left
    (docs/publishing.md), not by the whole --timeout: 3 s left of 600 s."""
    for name in XET_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    limit = deadline.Deadline(600)
    limit.end -= 597  # as if the audit and the preupload had taken 597 s
    with xet_side.upload_within(limit):
        during = {name: os.environ[name] for name in XET_SETTINGS}
    assert all(value.endswith("ms") for value in during.values()), during
    assert all(int(value[:-2]) <= 3000 for value in during.values()), during


@pytest.mark.parametrize(
    ("seconds_left", "during"),
    [
        # a long deadline: the user's 10 s budget and hf_xet's own values stand (timeouts capped at 60 s)
        pytest.param(600, ("10000ms", "3000ms", "60000ms", "60000ms"), id="long-deadline"),
        # 3 s left: a third for the retries, a thirtieth for the first delay
        pytest.param(3, ("1000ms", "100ms", "3000ms", "3000ms"), id="3s-left"),
    ],
)
def test_the_xet_clients_settings_are_capped_for_an_upload_never_raised_and_restored_after(
    monkeypatch, seconds_left, during
):
    """hf_xet's documented settings during an upload: the smaller of the user's value (else
    hf_xet's default: 360 s budget, 3 s base delay, 300 s read, 60 s connect) and the deadline's
    share; afterwards exactly what the process had, unset ones unset."""
    for name in XET_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_XET_CLIENT_RETRY_MAX_DURATION", "10s")
    before = {name: os.environ.get(name) for name in XET_SETTINGS}
    with xet_side.capped(seconds_left):
        assert tuple(os.environ[name] for name in XET_SETTINGS) == during
    assert {name: os.environ.get(name) for name in XET_SETTINGS} == before


@pytest.mark.parametrize(
    ("method", "url", "words"),
    [
        ("POST", "https://cas.example/v1/shards", "the Xet shard upload"),
        ("POST", "https://cas.example/v1/xorbs/default/ab12", "the Xet xorb upload"),
        ("GET", "https://cas.example/v1/xorb-grants/ab12", "the Xet xorb upload"),
        ("GET", "https://cas.example/v1/reconstructions/ab12", "a Xet download"),
        ("POST", "https://hub.example/api/models/a/b/preupload/main", "the preupload request"),
        ("POST", "https://hub.example/a/b.git/info/lfs/objects/batch", "the LFS batch request"),
        ("POST", "https://hub.example/api/models/a/b/commit/main", "the commit"),
        ("GET", "https://hub.example/api/models/a/b/xet-write-token/main", "the Xet token request"),
        ("POST", "https://hub.example/api/repos/create", "the repo creation"),
        ("POST", "https://hub.example/api/models/a/b/branch/dev", "the branch creation"),
        ("POST", "https://hub.example/api/models/a/b/tag/main", "tagging"),
        ("GET", "https://hub.example/api/models/a/b/tree/main/sub", "the file listing"),
        ("POST", "https://hub.example/api/models/a/b/paths-info/main", "the file listing"),
        ("GET", "https://hub.example/api/models/a/b/refs", "reading the refs"),
        ("GET", "https://hub.example/a/b/resolve/main/README.md", "a download"),
        ("GET", "https://hub.example/api/models/a/b/revision/main", "reading the branch head"),
        ("PUT", "https://s3.example/bucket/part-1?sig=x", "an upload"),
        ("POST", "https://hub.example/api/models/a/b/settings", "a POST request to hub.example"),
        ("GET", "https://s3.example/other", "a GET request to s3.example"),
    ],
)
def test_each_request_is_named_in_words_in_the_line_that_says_why_a_publish_stopped(method, url, words):
    """The one line after a timeout names what was running ("the Xet shard upload sent 6
    times"): each request by what it does, the rest by method and host."""
    assert deadline.describe_request(method, url) == words


def test_a_retry_after_in_seconds_is_waited_and_a_date_or_none_falls_back_to_our_backoff():
    def asked(value):
        headers = {} if value is None else {"Retry-After": value}
        return deadline.retry_after_s(httpx2.Headers(headers))

    assert [asked("2.5"), asked("0"), asked("30")] == [2.5, 0.0, 30.0]
    assert asked("Wed, 21 Oct 2015 07:28:00 GMT") is None  # an HTTP date: our own 1, 2, 4 s
    assert asked(None) is None


def test_why_a_publish_stopped_names_its_timeout_what_was_retried_and_the_last_error_in_one_line():
    limit = deadline.Deadline(45)
    passed = DeadlinePassed("no time left to retry the commit")
    assert limit.why("uploading and committing", passed) == (
        "publishing ran out of its 45s --timeout while uploading and committing"
    )
    limit.sent.update({"the commit": 1, "the Xet shard upload": 6, "the preupload request": 2})
    limit.note("HTTP 503\n  to   the Xet shard upload ")
    assert limit.retried() == "the Xet shard upload sent 6 times, the preupload request sent 2 times"
    assert limit.why("uploading and committing", passed) == (
        "publishing ran out of its 45s --timeout while uploading and committing (the Xet shard upload "
        "sent 6 times, the preupload request sent 2 times); last error: HTTP 503 to the Xet shard upload"
    )
    asked = DeadlinePassed("the Hub asks to wait 3600s before retrying the commit", 3600.0)
    assert limit.why("committing", asked) == (
        "publishing cannot finish within its 45s --timeout while committing: "
        "the Hub asks to wait 3600s before retrying the commit"
    )
    limit.note("x" * 299 + "yz")  # one line, at most 300 characters
    assert limit.last_error == "x" * 299 + "y"


@pytest.mark.parametrize(
    ("seconds_left", "users", "during"),
    [
        # hours left: hf_xet's own defaults stand (a 360 s budget, 3 s first delay; timeouts at most 60 s)
        pytest.param(7200, {}, ("360000ms", "3000ms", "60000ms", "60000ms"), id="hf-xet-defaults"),
        # a user's values in hf_xet's units (h, m, ms, s, bare seconds); one it cannot read: its default
        pytest.param(
            12000,
            {
                "HF_XET_CLIENT_RETRY_MAX_DURATION": "1h",
                "HF_XET_CLIENT_RETRY_BASE_DELAY": "2m",
                "HF_XET_CLIENT_READ_TIMEOUT": "1500ms",
                "HF_XET_CLIENT_CONNECT_TIMEOUT": " 7.5 s ",
            },
            ("3600000ms", "120000ms", "1500ms", "7500ms"),
            id="users-units",
        ),
        pytest.param(
            12000,
            {"HF_XET_CLIENT_RETRY_MAX_DURATION": "90", "HF_XET_CLIENT_RETRY_BASE_DELAY": "soon"},
            ("90000ms", "3000ms", "60000ms", "60000ms"),
            id="bare-seconds-and-unreadable",
        ),
        # set but empty: hf_xet's default during the upload, and the empty value restored after
        pytest.param(
            7200,
            {"HF_XET_CLIENT_READ_TIMEOUT": ""},
            ("360000ms", "3000ms", "60000ms", "60000ms"),
            id="empty-setting",
        ),
        # no time left at all: still one second to work with, not a zero budget hf_xet would refuse
        pytest.param(0.2, {}, ("333ms", "33ms", "1000ms", "1000ms"), id="no-time-left"),
    ],
)
def test_hf_xets_settings_during_an_upload_read_a_users_units_and_keep_its_defaults_when_time_allows(
    monkeypatch, seconds_left, users, during
):
    for name in XET_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    for name, value in users.items():
        monkeypatch.setenv(name, value)
    with xet_side.capped(seconds_left):
        assert tuple(os.environ[name] for name in XET_SETTINGS) == during
    assert {name: os.environ.get(name) for name in XET_SETTINGS} == {
        name: users.get(name) for name in XET_SETTINGS
    }


def test_under_the_deadline_a_request_keeps_the_clients_own_hooks_and_a_callers_own_trace(hub):
    """The deadline adds its hooks to the client's session and follows each connection through
    httpcore's ``trace`` extension: the client's own request hook (its request id, its offline
    mode) still runs, and a trace the request already had (a caller's own) is kept, not replaced."""
    seen: list[str] = []
    with deadline.Deadline(30).installed():
        answer = get_session().get(
            f"{hub.url}/api/models/alice/traced", extensions={"trace": lambda event, info: seen.append(event)}
        )
    assert answer.status_code == 404 and answer.request.headers.get("X-Amzn-Trace-Id"), answer.request.headers
    assert {"connection.connect_tcp.complete", "http11.receive_response_headers.complete"} <= set(seen), seen


def test_a_retry_after_ending_exactly_at_the_deadline_ends_the_request_and_one_before_it_is_the_clients(
    hub, clock
):
    path, url = r"/api/models/alice/boundary$", f"{hub.url}/api/models/alice/boundary"
    hub.rate_limit_next(times=2, retry_after=1, method="GET", path=path)
    limit = deadline.Deadline(10)
    with limit.installed():
        clock[0] += 8.75  # 1.25 s left: a 1 s wait fits
        assert get_session().get(url).status_code == 429
        clock[0] += 0.25  # 1 s left: the retry could not start before the deadline
        with pytest.raises(DeadlinePassed, match="asks to wait 1s before retrying") as asked:
            get_session().get(url)
    assert asked.value.asked == 1


def test_no_request_is_sent_once_the_deadline_has_passed(hub):
    """A request asked for after the time is up fails at once, naming what it would have done,
    and never reaches the Hub; one asked for before it is sent."""
    limit = deadline.Deadline(0.5)
    with limit.installed():
        assert get_session().get(f"{hub.url}/api/models/alice/none/revision/main").status_code == 404
        time.sleep(max(0.0, limit.remaining()) + 0.01)
        with pytest.raises(DeadlinePassed) as passed:
            get_session().get(f"{hub.url}/api/models/alice/none/revision/main")
    assert str(passed.value) == "reading the branch head was not sent"
    assert hub.count() == 1 and dict(limit.sent) == {"reading the branch head": 1}


def test_a_request_sent_again_after_its_answer_never_came_is_the_last_error_a_timeout_names(monkeypatch):
    """A request that got no answer (its read timed out) and is sent again is noted: if the time
    then runs out, the one line says what went unanswered, not an older error or none."""
    import socket

    monkeypatch.setattr(deadline, "REQUEST_TIMEOUT_S", 0.2)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # the kernel completes the handshakes; nobody ever reads or replies
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/api/models/alice/silent/revision/main"
    limit = deadline.Deadline(30)
    try:
        with limit.installed():
            with pytest.raises(httpx2.TimeoutException):
                get_session().get(url)
            assert limit.last_error is None  # a first try that timed out is not yet a retry
            with pytest.raises(httpx2.TimeoutException):
                get_session().get(url)
    finally:
        listener.close()
    assert limit.why("reading the branch head", DeadlinePassed("reading the branch head was not sent")) == (
        "publishing ran out of its 30s --timeout while reading the branch head (reading the branch head sent "
        "2 times); last error: no answer to reading the branch head (timed out or connection lost)"
    )


def test_a_connection_made_just_as_the_deadline_passes_is_cut_before_the_request_is_sent(hub, clock):
    """The deadline can pass between the check before a request and its connection: the
    connection is cut as soon as it is made, and the request fails naming what it waited for."""

    def deadline_passes_as_it_connects(event: str, info: dict) -> None:
        if event == "connection.connect_tcp.complete":
            clock[0] += 10

    limit = deadline.Deadline(10)
    with limit.installed(), pytest.raises(DeadlinePassed) as passed:
        get_session().get(
            f"{hub.url}/api/models/alice/none/revision/main",
            extensions={"trace": deadline_passes_as_it_connects},
        )
    assert str(passed.value) == (
        f"no answer from {hub.url} to reading the branch head within 10s, all the --timeout had left"
    )
    assert hub.count() == 0 and limit.last_error == str(passed.value)
