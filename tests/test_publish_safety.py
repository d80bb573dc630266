"""06 against a hostile stage and a Hub that stops answering or fails, within its --timeout.

Real scripts as subprocesses where exit codes and output matter, publish() in this process
where a fault has to be placed between two steps; always the real huggingface_hub client
against localhub over loopback.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest
import test_publish
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
from test_leaks import SAMPLES
from test_publish import (
    TOKEN,
    api_for,
    commit_titles,
    one_error_line,
    publish_here,
    run_publish,
    write_requests,
)

from pipeline.audit import audit_stage, parse_manifest, stage_lock
from pipeline.errors import (
    PublishError,
    ReceiptNotWritten,
    SecretInStage,
    StageError,
    StaleBranch,
    TokenRejected,
    UploadInterrupted,
    VerificationFailed,
)
from pipeline.leaks import KINDS, leak_rules
from pipeline.publishing.client import Target, http_error, hub_errors, network_words
from pipeline.publishing.deadline import Deadline

from support import TREE_PATH

# An endpoint nothing listens on, for the messages about one.
HUB = "http://127.0.0.1:1"

# The loopback Hub fixtures of test_publish.py (hf_env and waits are autouse there, and so here).
hf_env, hub, token_env, no_client_sleep, waits = (
    test_publish.hf_env,
    test_publish.hub,
    test_publish.token_env,
    test_publish.no_client_sleep,
    test_publish.waits,
)

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


def error_line_after_uploads(result) -> str:
    """Exit 2 with exactly one ``error:`` line, the last one (the client's upload bars may precede it)."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    return errors[0]


def plant(stage: Path, text: str, name: str = "README.md") -> None:
    """Append ``text`` to a staged file and regenerate meta.json's files table and the manifest."""
    with open(stage / name, "a") as card:
        card.write(text)
    meta = json.loads((stage / "meta.json").read_text())
    if name in meta["files"]:
        data = (stage / name).read_bytes()
        meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        (stage / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    names = sorted(parse_manifest((stage / "MANIFEST.sha256").read_bytes()))
    (stage / "MANIFEST.sha256").write_text(
        "".join(f"{hashlib.sha256((stage / n).read_bytes()).hexdigest()}  {n}\n" for n in names)
    )


PLANTED = {  # what is planted, and the words of the refusal; credential samples from test_leaks.py
    "hf_token_value": (f"\nask {TOKEN}\n", "the value of HF_TOKEN"),
    "hf_pattern": ("\nhf_" + "x9Y" * 12 + "\n", "an hf_ token"),
    "home_folder": (f"\nbuilt in {os.path.expanduser('~')}/work\n", "the home folder's path"),
    "private_key": (
        "\n-----BEGIN PRIVATE KEY-----\nMIGHAgEAMBMG\n-----END PRIVATE KEY-----\n",
        "a PEM private key",
    ),
    **{
        kind: (f"\n{SAMPLES[kind][1]}\n", SAMPLES[kind][0])
        for kind in ("aws-key", "github-token", "openai-key")
    },
}


@pytest.mark.parametrize(
    ("planted", "place"),
    [(kind, "card") for kind in sorted(PLANTED)]
    + [(kind, "code") for kind in ("aws-key", "github-token", "openai-key")],
)
def test_06_rescans_the_stage_and_refuses_a_leak_before_any_request(
    staged_run, run_copy, hub, tmp_path, planted, place
):
    run = run_copy(staged_run)
    text, kind = PLANTED[planted]
    code = sorted(p.relative_to(run.stage).as_posix() for p in (run.stage / "code").rglob("*.py"))
    name = "README.md" if place == "card" else code[-1]
    plant(run.stage, text, name)
    result = run_publish(run.stage, hub, "alice/leaky", tmp_path / "receipts")  # fails on a printed token
    line = one_error_line(result)
    assert line.startswith(f"error: {name} holds {kind}; nothing was published (no request was sent)"), line
    secret = text.strip().split()[-1].strip('"')[-12:]
    assert secret not in result.stdout + result.stderr and "MIGHAgEAMBMG" not in result.stdout + result.stderr
    assert hub.count() == 0


def test_no_request_reaches_the_hub_before_the_audit_has_passed(staged_run, hub, tmp_path, token_env):
    # The audit reads on its own thread while the Hub client loads; the first request, even a
    # read, still waits for its result (a failed audit sends none: the test above).
    at_audit: list[dict[str, int]] = []

    def say(line: str) -> None:
        if line.startswith("audited "):
            at_audit.append(hub.request_counts())

    result = publish_here(staged_run.stage, hub, "alice/audited-first", tmp_path, say=say)
    assert result.status == "published" and write_requests(hub) > 0
    assert at_audit == [{}]


def test_publish_up_to_the_audit_leaves_the_hub_client_unloaded(tmp_path):
    # What publish() runs before the audit starts imports no part of the Hub client (HfApi, httpx),
    # which then loads beside the audit instead of before it: a third of a second of 06's time.
    code = (
        "import sys\n"
        "from pipeline.publishing import Publication, format_plan, publish\n"
        "import pipeline.publishing.start\n"
        "client = ('httpx2', 'huggingface_hub.hf_api', 'huggingface_hub.errors', 'huggingface_hub.utils')\n"
        "print(sorted(name for name in client if name in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": TREE_PATH}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_05_refuses_a_card_holding_cloud_keys_naming_each_and_keeps_the_stage(staged_run, run_copy):
    run = run_copy(staged_run)
    before = (run.stage / "README.md").read_bytes()
    keys = [SAMPLES[kind][1].split()[-1] for kind in ("aws-key", "github-token", "openai-key")]
    result = run.script("05_stage.py", "--set", f"card.description=Pull with {' or '.join(keys)}.")
    line = one_error_line(result)
    assert line.startswith(
        "error: README.md, config.json and meta.json hold an AWS access key, a GitHub token and an OpenAI "
        "API key; nothing was staged."
    ), line
    assert "nothing was staged" in line and not any(
        key[-12:] in result.stdout + result.stderr for key in keys
    )
    assert (run.stage / "README.md").read_bytes() == before


def test_a_false_positive_allowed_by_the_config_is_staged_recorded_and_published_and_only_there(
    staged_run, run_copy, hub, tmp_path
):
    run = run_copy(staged_run)
    what, text = SAMPLES["jwt"]
    example = text.split()[-1]
    describe = ["--set", f"card.description=A request carries {example} in its header."]
    refused = one_error_line(run.script("05_stage.py", *describe))
    assert refused.startswith(f"error: README.md, config.json and meta.json hold {what};"), refused
    # The card's text is also in the staged config and meta.json: the fix names every file.
    entries = re.search(r"card\.allow_leaks: (\{.*\}) \(docs/publishing\.md\)", refused).group(1)
    assert "README.md: [jwt]" in entries
    run.ok("05_stage.py", *describe, "--set", f"card.allow_leaks={entries}")
    allowed = json.loads((run.stage / "meta.json").read_text())["config"]["card"]["allow_leaks"]
    assert allowed["README.md"] == ["jwt"]  # recorded where 06 reads it
    planned = run_publish(run.stage, hub, "alice/example", tmp_path / "receipts", "--dry-run")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert f"leak scan: README.md holds {what}, allowed by the stage's card.allow_leaks" in planned.stdout
    code = sorted(p.relative_to(run.stage).as_posix() for p in (run.stage / "code").rglob("*.py"))[-1]
    plant(run.stage, f"\n# {example}\n", code)  # the same value in another file
    line = one_error_line(run_publish(run.stage, hub, "alice/example", tmp_path / "receipts", "--dry-run"))
    assert line.startswith(f"error: {code} holds {what}; nothing was published"), line
    assert hub.count() == 1  # the first dry run's read of the branch head, nothing since


# -- secrets an adversary got published: each form, in each kind of staged file, edited in after 05 --


def restage(stage: Path, name: str, data: bytes) -> None:
    """Write a staged file (new or replaced) and record it in meta.json and the manifest, as
    an edit that knows the stage's format would."""
    (stage / name).write_bytes(data)
    meta = json.loads((stage / "meta.json").read_text())
    if name != "README.md":
        meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        (stage / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    names = sorted({*parse_manifest((stage / "MANIFEST.sha256").read_bytes()), name})
    (stage / "MANIFEST.sha256").write_text(
        "".join(f"{hashlib.sha256((stage / n).read_bytes()).hexdigest()}  {n}\n" for n in names)
    )


HF = SAMPLES["hf-token"][1]
# Written as found in the stage: encoded forms of an hf_ token, a PEM header split across lines,
# and a key of each provider that once had no rule or was missed in a weights header.
ADVERSARY = {
    "hf_ token, base64": (base64.b64encode(HF.encode()).decode(), "hf-token"),
    "hf_ token, hex": (HF.encode().hex(), "hf-token"),
    "hf_ token, URL-encoded": ("hf%5F" + HF[3:], "hf-token"),
    "hf_ token, zero-width space": ("hf_\u200b" + HF[3:], "hf-token"),
    "hf_ token, JSON-escaped": ("\\u0068" + HF[1:], "hf-token"),
    "PEM header across lines": ("-----BEGIN RSA PRIVATE\n" + "KEY-----", "private-key"),
    **{
        kind: (SAMPLES[kind][1], kind)
        for kind in (
            "anthropic-key",
            "stripe-key",
            "gitlab-token",
            "npm-token",
            "sendgrid-key",
            "azure-key",
            "gcp-service-account",
            "database-url",
            "telegram-bot-token",
            "databricks-token",
            "github-token",
            "aws-key",
            "openai-key",
            "slack-token",
            "jwt",
        )
    },
}


def in_json_string(text: str) -> str:
    return text.replace('"', '\\"').replace("\n", "\\n")


def weights_with_note(original: bytes, text: str) -> bytes:
    """The staged weights with ``text`` in their header's ``__metadata__`` (tensors unchanged)."""
    length = int.from_bytes(original[:8], "little")
    tensors = json.loads(original[8 : 8 + length])
    tensors.pop("__metadata__", None)
    header = '{"__metadata__":{"format":"pt","note":"' + in_json_string(text) + '"},'
    header = (header + json.dumps(tensors, separators=(",", ":"))[1:]).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + original[8 + length :]


def test_06_audit_refuses_every_form_an_adversary_published_in_every_kind_of_staged_file(
    staged_run, run_copy
):
    run = run_copy(staged_run)
    stage = run.stage
    code = sorted(p.relative_to(stage).as_posix() for p in (stage / "code").rglob("*.py"))[-1]
    original = {p.relative_to(stage).as_posix(): p.read_bytes() for p in stage.rglob("*") if p.is_file()}
    places = {
        "README.md": lambda text: original["README.md"] + f"\n{text}\n".encode(),
        code: lambda text: original[code] + f"\n# {text}\n".encode(),
        "tokenizer.json": lambda text: (
            '{"added_tokens":[{"content":"' + in_json_string(text) + '"}]}'
        ).encode(),
        "modelo.safetensors": lambda text: weights_with_note(original["modelo.safetensors"], text),
    }
    words = {kind.id: kind.what for kind in KINDS}
    rules = leak_rules(environ={})
    assert audit_stage(stage, leaks=rules)  # the stage as 05 built it passes
    missed = []
    for name, write in places.items():
        for label, (text, kind) in ADVERSARY.items():
            restage(stage, name, write(text))
            try:
                audit_stage(stage, leaks=rules, consequence="nothing was published")
                missed.append(f"{label} in {name}: published")
            except SecretInStage as refused:
                if not str(refused).startswith(f"{name} holds {words[kind]}"):
                    missed.append(f"{label} in {name}: {refused}")
            for path in (name, "meta.json", "MANIFEST.sha256"):  # back to the stage 05 built
                (stage / path).unlink()
                if path in original:
                    (stage / path).write_bytes(original[path])
    assert missed == []


def test_06_refuses_a_key_in_a_weights_header_and_an_escaped_token_in_a_hub_file_naming_both(
    staged_run, run_copy, hub, tmp_path
):
    run = run_copy(staged_run)
    weights = (run.stage / "modelo.safetensors").read_bytes()
    restage(run.stage, "modelo.safetensors", weights_with_note(weights, SAMPLES["github-token"][1]))
    restage(run.stage, "tokenizer.json", ('{"model":{"vocab":{"\\u0068' + HF[1:] + '":0}}}').encode())
    result = run_publish(run.stage, hub, "alice/header", tmp_path / "receipts")
    line = one_error_line(result)
    assert line.startswith(
        "error: modelo.safetensors holds a GitHub token; tokenizer.json holds an hf_ token (escaped); "
        "nothing was published (no request was sent)"
    ), line
    assert HF[-12:] not in result.stdout + result.stderr and hub.count() == 0


def test_a_commit_whose_answer_is_withheld_is_found_on_the_branch_and_a_rerun_adds_nothing(
    staged_run, hub, tmp_path
):
    hub.withhold_next_commit_answer()  # the Hub applies the commit, then never answers
    started = time.monotonic()
    first = run_publish(staged_run.stage, hub, "alice/lost", tmp_path / "receipts", "--timeout", "4")
    elapsed = time.monotonic() - started
    assert first.returncode == 0, first.stdout + first.stderr
    assert elapsed < 90
    assert "the answer to the commit was lost, but the commit landed" in first.stdout
    assert "the Hub's answer to the commit was lost; the commit was found on the branch" in first.stdout
    assert len(commit_titles(hub, "alice/lost")) == 2
    rerun = run_publish(staged_run.stage, hub, "alice/lost", tmp_path / "receipts", "--timeout", "4")
    assert rerun.returncode == 0 and "nothing to publish" in rerun.stdout, rerun.stdout + rerun.stderr
    assert len(commit_titles(hub, "alice/lost")) == 2


def test_a_commit_that_times_out_without_landing_says_nothing_was_committed(staged_run, hub, tmp_path):
    hub.withhold_next_commit_answer(apply=False)
    result = run_publish(staged_run.stage, hub, "alice/timeout", tmp_path / "receipts", "--timeout", "3")
    line = error_line_after_uploads(result)
    assert (
        f"no answer from {hub.url} to the commit within" in line and "all the --timeout had left" in line
    ), line
    assert "nothing was committed" in line
    assert "landed" not in line
    assert commit_titles(hub, "alice/timeout") == ["initial commit"]


def test_under_path_in_repo_a_commit_whose_answer_was_lost_is_found_in_its_folder(
    staged_run, hub, tmp_path, token_env
):
    """The landed commit holds the stage under model/: that folder, not the repo root, is
    compared with the stage, so the commit is found and the publish succeeds."""
    hub.withhold_next_commit_answer()  # the Hub applies the commit, then never answers
    said: list[str] = []
    result = publish_here(
        staged_run.stage,
        hub,
        "alice/lost-in-folder",
        tmp_path,
        say=said.append,
        path_in_repo="model",
        timeout_s=3,
    )
    head = api_for(hub).list_repo_commits("alice/lost-in-folder")[0].commit_id
    assert (result.status, result.commit, result.answer_lost) == ("published", head, True)
    assert f"the answer to the commit was lost, but the commit landed: {head}" in said
    assert len(commit_titles(hub, "alice/lost-in-folder")) == 2
    test_publish.assert_holds_exactly_the_stage(
        hub, "alice/lost-in-folder", staged_run.stage, prefix="model/"
    )


def test_an_invalid_repo_id_is_one_line_naming_it(staged_run, hub, tmp_path):
    line = one_error_line(run_publish(staged_run.stage, hub, "bad repo/../x", tmp_path / "receipts"))
    assert "--repo-id 'bad repo/../x' is not a valid Hub repo id" in line
    assert hub.count() == 0


def test_a_receipt_folder_that_cannot_be_written_is_refused_before_any_write(staged_run, hub, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the receipt folder should be")
    line = one_error_line(run_publish(staged_run.stage, hub, "alice/noreceipt", blocker / "receipts"))
    assert "--receipt-dir" in line and "cannot be created" in line and "nothing was published" in line
    assert write_requests(hub) == 0


def test_a_receipt_that_cannot_be_written_after_landing_says_the_commit_landed(
    staged_run, hub, tmp_path, token_env
):
    receipts = tmp_path / "receipts"

    def receipt_folder_disappears(line: str) -> None:
        # After the commit landed, the receipt folder is replaced by a file (a real OS failure follows).
        if line.startswith("verifying"):
            receipts.rmdir()
            receipts.write_text("in the way")

    with pytest.raises(ReceiptNotWritten) as failed:
        publish_here(staged_run.stage, hub, "alice/receipt", tmp_path, say=receipt_folder_disappears)
    head = api_for(hub).repo_info("alice/receipt").sha
    message = str(failed.value)
    assert failed.value.exit_code == 1
    assert message == (
        f"commit {hub.url}/alice/receipt/commit/{head} landed and was verified, but the receipt could not be "
        f"written to {receipts}/alice--receipt-{head[:12]}.json (File exists); rerun with a writable "
        "--receipt-dir to write it (no second commit is made)"
    )
    assert len(commit_titles(hub, "alice/receipt")) == 2
    # The rerun commits nothing: the commit it verifies was already on the Hub.
    receipts.unlink()
    receipts.mkdir()
    with pytest.raises(ReceiptNotWritten) as failed:
        publish_here(staged_run.stage, hub, "alice/receipt", tmp_path, say=receipt_folder_disappears)
    assert str(failed.value) == (
        f"commit {hub.url}/alice/receipt/commit/{head} is on the Hub and was verified, but the receipt could "
        f"not be written to {receipts}/alice--receipt-{head[:12]}.json (File exists); rerun with a writable "
        "--receipt-dir to write it (no second commit is made)"
    )
    assert len(commit_titles(hub, "alice/receipt")) == 2


def test_a_verification_that_cannot_read_the_hub_says_landed_and_never_nothing_committed(
    staged_run, hub, tmp_path, token_env, monkeypatch, no_client_sleep
):
    real_create_commit = HfApi.create_commit
    card_sha = parse_manifest((staged_run.stage / "MANIFEST.sha256").read_bytes())["README.md"]

    def storage_truncates_the_card(self, *args, **kwargs):
        info = real_create_commit(self, *args, **kwargs)
        stored = hub.store.object_path(card_sha)
        stored.write_bytes(stored.read_bytes()[:10])  # the Hub now answers 500 for it
        return info

    monkeypatch.setattr(HfApi, "create_commit", storage_truncates_the_card)
    with pytest.raises(VerificationFailed) as failed:
        publish_here(staged_run.stage, hub, "alice/unreadable", tmp_path)
    message = str(failed.value)
    assert failed.value.exit_code == 1 and "landed" in message and "nothing was committed" not in message


def _offline_target(deadline: Deadline) -> Target:
    """A publish target of alice/x at an endpoint nothing listens on, for the words about it."""
    return Target(HfApi(endpoint=HUB, token=TOKEN), HUB, "alice/x", "main", "", TOKEN, deadline)


def test_the_token_is_not_in_the_repr_of_the_publish_target():
    target = _offline_target(Deadline(60))
    assert TOKEN not in repr(target) and "alice/x" in repr(target)


@pytest.mark.parametrize("at", [0, 270, 280, 290])
def test_a_lost_connection_is_told_in_one_line_without_the_token_wherever_the_line_is_cut(at):
    """A client error may quote the request with its token, and the line is cut at 300
    characters: the token is scrubbed before the cut, so no piece of it survives."""
    target = _offline_target(Deadline(60))
    said = network_words(target, OSError(f"{'x' * at}Bearer {TOKEN} refused\nthe rest of the story"))
    assert said.startswith("connection to http://127.0.0.1:1 lost (OSError: xxx" if at else "connection to")
    assert TOKEN[:6] not in said and "\n" not in said and "the rest" not in said, said
    assert ("<token>" in said) == (len(f"OSError: {'x' * at}Bearer <token>") <= 300), said


def test_a_lost_request_is_told_by_what_it_was_how_long_it_waited_and_what_gave_up():
    """A timeout names the request and the wait it had (and says when that was all the --timeout
    had left), a host that does not resolve names the endpoint to check, and the Xet client's
    failure names the CAS request it gave up on."""
    limit = Deadline(60)
    limit.bounds["the commit"] = 2.5  # the deadline's bound on the last commit request
    target = _offline_target(limit)
    commit = httpx2.Request("POST", f"{HUB}/api/models/alice/x/commit/main")
    head = httpx2.Request("GET", f"{HUB}/api/models/alice/x/revision/main")
    try:
        try:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        except socket.gaierror as lookup:
            raise httpx2.ConnectError("[Errno -2] Name or service not known") from lookup
    except httpx2.ConnectError as failed:
        unresolved = failed
    said = [
        network_words(target, httpx2.ReadTimeout("timed out", request=commit)),
        network_words(target, httpx2.ConnectTimeout("timed out", request=head)),
        network_words(target, unresolved),
        network_words(target, ConnectionError(f"Request failed: {HUB}/v1/shards: 503")),
    ]
    assert said == [
        f"no answer from {HUB} to the commit within 2.5s, all the --timeout had left (ReadTimeout)",
        f"no answer from {HUB} to reading the branch head within 60s (ConnectTimeout)",
        f"the host 127.0.0.1 of the endpoint {HUB} cannot be resolved (Name or service not known): "
        "check --endpoint / HF_ENDPOINT and the network",
        "the Xet client gave up on the Xet shard upload after its retries, capped by the 60s --timeout "
        f"(ConnectionError: Request failed: {HUB}/v1/shards: 503)",
    ]
    with pytest.raises(PublishError) as refused, hub_errors(target, "reading branch main"):
        raise unresolved
    assert (type(refused.value), str(refused.value)) == (
        PublishError,
        f"{said[2]} while reading branch main; nothing was committed",
    )


@pytest.mark.parametrize(
    "status, kind, message",
    [
        (
            code,
            TokenRejected,
            "token rejected or no write access to alice/x at http://127.0.0.1:1 (HTTP {code} while "
            "uploading and committing): check HF_TOKEN / `hf auth login` and that the token may write to "
            "this namespace; nothing was committed",
        )
        for code in (401, 403)
    ]
    + [
        (
            412,
            StaleBranch,
            "someone pushed to main of alice/x since it was read; nothing was written; rerun to publish "
            "on top of the new head",
        ),
        (
            409,
            PublishError,
            "the Hub answered HTTP 409 while uploading and committing on alice/x: refused, token <token>; "
            "nothing was committed",
        ),
    ],
    ids=["401", "403", "412", "other"],
)
def test_each_error_answer_of_the_hub_is_one_line_saying_what_it_means(status, kind, message):
    """401 and 403 both mean the token may not write, 412 a push since the head was read; any other
    error answer is quoted, the token scrubbed."""
    target = _offline_target(Deadline(60))
    answer = httpx2.Response(
        status, request=httpx2.Request("POST", "http://127.0.0.1:1/api/models/alice/x/commit/main")
    )
    error = http_error(
        target,
        "uploading and committing",
        HfHubHTTPError("refused", response=answer, server_message=f"refused, token {TOKEN}"),
        "nothing was committed",
    )
    assert (type(error), str(error)) == (kind, message.format(code=status))


def test_the_stage_lock_is_beside_the_stage_not_on_its_parent(staged_run, tmp_path):
    parent = os.open(staged_run.root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # Another tool holding a lock on the repository folder must not block staging or publishing.
        fcntl.flock(parent, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with stage_lock(staged_run.stage):
            with pytest.raises(StageError, match="being staged or published by another process"):
                with stage_lock(staged_run.stage):
                    pass
    finally:
        os.close(parent)
    assert (staged_run.root / ".hub_stage.lock").is_file()


def test_a_non_positive_timeout_is_refused(staged_run, hub, tmp_path, token_env):
    with pytest.raises(PublishError, match="--timeout 0 must be a number of seconds above 0"):
        publish_here(staged_run.stage, hub, "alice/t", tmp_path, timeout_s=0)


def test_a_hub_that_accepts_but_never_answers_a_read_is_one_line_within_the_timeout(staged_run, tmp_path):
    """The first request of 06 is a read (the branch head); a listener that accepts the
    connection and never replies must not hold 06 past its --timeout."""
    import socket
    from types import SimpleNamespace

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # the kernel completes the handshakes; nobody ever reads or replies
    silent = SimpleNamespace(url=f"http://127.0.0.1:{listener.getsockname()[1]}")
    try:
        started = time.monotonic()
        # Unbounded, 06 would wait for as long as the listener is open: subprocess.run's limit ends it.
        result = run_publish(
            staged_run.stage, silent, "alice/silent", tmp_path / "receipts", "--timeout", "1", timeout=90
        )
        elapsed = time.monotonic() - started
    finally:
        listener.close()
    line = one_error_line(result)
    assert "ran out of its 1s --timeout while reading branch main" in line, line
    assert (
        f"no answer from {silent.url} to reading the branch head" in line and "nothing was committed" in line
    ), line
    assert elapsed < 30, elapsed


def test_a_pull_request_whose_answer_is_lost_is_found_and_not_opened_twice(
    staged_run, run_copy, hub, tmp_path, token_env
):
    first = publish_here(staged_run.stage, hub, "alice/pr-lost", tmp_path)
    assert first.status == "published"
    changed = run_copy(staged_run)
    changed.ok("05_stage.py", "--set", "card.description=A second version.")
    api = api_for(hub)
    api.upload_file(
        path_or_fileobj=b"a note\n",
        path_in_repo="notes.txt",
        repo_id="alice/pr-lost",
        commit_message="someone else's pull request",
        create_pr=True,
    )
    hub.withhold_next_commit_answer()  # our pull request is opened, then its answer never comes
    lines: list[str] = []
    result = publish_here(
        changed.stage, hub, "alice/pr-lost", tmp_path, create_pr=True, timeout_s=2, say=lines.append
    )
    assert result.status == "published", result
    assert any("the answer to the commit was lost, but the commit landed" in line for line in lines), lines
    pulls = api.list_repo_refs("alice/pr-lost", include_pull_requests=True).pull_requests
    assert [p.ref for p in pulls] == ["refs/pr/1", "refs/pr/2"], pulls
    assert result.commit == pulls[1].target_commit and api.repo_info("alice/pr-lost").sha == first.commit


def test_a_pull_request_opened_before_the_publish_is_never_taken_for_the_one_whose_answer_was_lost(
    staged_run, run_copy, hub, tmp_path, token_env, monkeypatch, waits
):
    """An earlier ``--create-pr`` of the same stage left a pull request holding exactly it; this
    publish's commit breaks before it lands. That older pull request is not this commit: 06 says
    nothing was committed, not that it landed."""
    assert publish_here(staged_run.stage, hub, "alice/pr-older", tmp_path).status == "published"
    changed = run_copy(staged_run)
    changed.ok("05_stage.py", "--set", "card.description=A second version.")
    earlier = publish_here(changed.stage, hub, "alice/pr-older", tmp_path, create_pr=True)
    assert earlier.status == "published"

    def connection_lost(self, repo_id, *args, **kwargs):
        raise httpx2.ConnectError("connection reset by peer")

    monkeypatch.setattr(HfApi, "create_commit", connection_lost)
    with pytest.raises(UploadInterrupted) as interrupted:
        publish_here(changed.stage, hub, "alice/pr-older", tmp_path, create_pr=True)
    assert str(interrupted.value).endswith(
        " while uploading and committing, and no pull request opened since the plan holds the stage: nothing "
        "was committed; rerun: it skips blobs already uploaded and never makes a second commit"
    ), str(interrupted.value)
    pulls = api_for(hub).list_repo_refs("alice/pr-older", include_pull_requests=True).pull_requests
    assert [(p.ref, p.target_commit) for p in pulls] == [("refs/pr/1", earlier.commit)], pulls
