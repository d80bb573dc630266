"""The model card: valid UTF-8 text whatever the sample holds, Hub metadata set and validated
in the config's card section, and statements that are true for the staged checkpoint."""

from __future__ import annotations

import json
import os
import re
import socket
import unicodedata

import pytest
from huggingface_hub import HfApi, ModelCard

from localhub import LocalHub
from pipeline.config import load_config
from pipeline.errors import ConfigError, StageError
from pipeline.stage.card import MAX_SECTIONS, build_model_card, read_user_sections
from pipeline.stage.card_parts import card_data, fence, number, printable
from pipeline.stage.record import proof_verdict

from support import REPO, publish_stage

TOKEN = "card-test-token"
EVERY_BYTE = "".join(chr(code) for code in range(256))


def _with_sample(run, sample: str) -> None:
    record = json.loads(run.metrics.read_text(encoding="utf-8"))
    record["sample"] = sample
    run.metrics.write_text(json.dumps(record), encoding="utf-8")


def test_a_sample_of_every_byte_publishes_as_a_regular_text_readme(evaluated_run, run_copy, tmp_path):
    run = run_copy(evaluated_run)
    # Every byte value as a character, and a lone surrogate that strict UTF-8 cannot encode.
    _with_sample(run, "HAMLET:\n" + EVERY_BYTE + "\ud800 end")
    run.ok("05_stage.py", "--repo-id", "test/every-byte")
    raw = (run.stage / "README.md").read_bytes()
    text = raw.decode("utf-8")  # strict: valid UTF-8
    assert not [c for c in text if unicodedata.category(c) in ("Cc", "Cs") and c not in "\n\t"]
    assert "\\x00" in text and "\\x1b" in text and "\\x7f" in text and "\\ud800" in text and "ÿ" in text
    with LocalHub(tmp_path / "hub", token=TOKEN) as hub:
        result = publish_stage(run.stage, hub.url, "test/every-byte", TOKEN)
        assert result.returncode == 0, result.stdout + result.stderr
        entry = next(
            e
            for e in HfApi(endpoint=hub.url, token=TOKEN).list_repo_tree("test/every-byte")
            if e.path == "README.md"
        )
        assert entry.lfs is None, "README.md must land as a regular text file"


def test_the_local_hub_rejects_a_regular_file_with_a_nul_byte_like_the_real_hub(tmp_path):
    api_payload = "\n".join(
        [
            json.dumps({"key": "header", "value": {"summary": "binary"}}),
            json.dumps(
                {
                    "key": "file",
                    "value": {"path": "README.md", "encoding": "base64", "content": "IyB0aXRsZQp0ZXh0AAo="},
                }
            ),  # "# title\ntext\0\n"
        ]
    )
    with LocalHub(tmp_path / "hub", token=TOKEN) as hub:
        api = HfApi(endpoint=hub.url, token=TOKEN)
        api.create_repo("test/binary")
        host, port = hub.url.removeprefix("http://").split(":")
        body = api_payload.encode()
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(
                b"POST /api/models/test/binary/commit/main HTTP/1.1\r\nHost: x\r\n"
                + f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/x-ndjson\r\n".encode()
                + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 400") or answer.startswith(b"HTTP/1.0 400"), answer[:200]
        assert b"binary" in answer


def test_card_section_sets_the_hub_metadata_and_the_evaluation_dataset(evaluated_run, run_copy):
    run = run_copy(evaluated_run)
    run.ok(
        "05_stage.py",
        "--set",
        "card.datasets=[karpathy/tiny_shakespeare]",
        "--set",
        "card.language=[en]",
        "--set",
        "card.pipeline_tag=tabular-regression",
        "--set",
        "card.base_model=someone/base-mlp",
        "--set",
        "card.license=mit",
        "--set",
        "card.tags=[regression, toy]",
    )
    card = ModelCard.load(run.stage / "README.md")
    data = card.data
    assert (
        data.library_name,
        data.pipeline_tag,
        data.language,
        data.datasets,
        data.base_model,
        data.license,
        data.tags,
    ) == (
        "pytorch",
        "tabular-regression",
        ["en"],
        ["karpathy/tiny_shakespeare"],
        "someone/base-mlp",
        "mit",
        ["regression", "toy"],
    )
    assert {(r.dataset_name, r.dataset_type, r.task_type) for r in data.eval_results} == {
        ("karpathy/tiny_shakespeare", "karpathy/tiny_shakespeare", "tabular-regression")
    }
    run.ok(
        "05_stage.py",
        "--set",
        "card.eval_dataset_name=Held-out rows",
        "--set",
        "card.eval_dataset_type=custom",
        "--set",
        "card.library_name=my-lib",
    )
    data = ModelCard.load(run.stage / "README.md").data
    assert {(r.dataset_name, r.dataset_type) for r in data.eval_results} == {("Held-out rows", "custom")}
    assert data.library_name == "my-lib"


def test_invalid_card_metadata_is_refused_with_the_key_named(evaluated_run, run_copy):
    run = run_copy(evaluated_run)
    for setting, key in (
        ("card.language=[EN!]", "card.language"),
        ("card.datasets=[a b]", "card.datasets"),
        ("card.pipeline_tag=Text Generation", "card.pipeline_tag"),
        ("card.base_model=/home/x/model", "card.base_model"),
    ):
        assert key in run.refused("05_stage.py", "--set", setting)


@pytest.mark.parametrize(
    ("key", "good", "refusal"),
    [
        ("card.language", ["pt-BR"], "card.language holds 'pt-BR\\n', which is not an ISO 639 code"),
        (
            "card.datasets",
            ["someone/data"],
            "card.datasets holds 'someone/data\\n', which is not a Hub dataset id",
        ),
        ("card.pipeline_tag", "tabular-regression", "card.pipeline_tag must be a Hub task"),
        ("card.library_name", "my-lib", "card.library_name must be a Hub library name"),
        ("card.base_model", "someone/base-mlp", "card.base_model must be a Hub model id"),
    ],
)
def test_card_metadata_ending_in_a_line_break_is_refused_by_the_config(key, good, refusal):
    """Each value goes into the card's front matter as one line: it must end where its name
    does (a final line break is not one, though a pattern ending in $ lets it through)."""
    load_config(REPO / "config.yaml", {key: good})
    bad = [good[0] + "\n"] if isinstance(good, list) else good + "\n"
    with pytest.raises(ConfigError) as refused:
        load_config(REPO / "config.yaml", {key: bad})
    assert str(refused.value).startswith(f"{REPO / 'config.yaml'} (with command-line overrides): {refusal}")


def test_card_says_an_intermediate_checkpoint_is_one(trained_run, run_copy):
    run = run_copy(trained_run)
    run.ok("02_train.py", "--quiet", "--checkpoint-dir", "partial", "--stop-at", "4")
    run.ok("05_stage.py", "--no-metrics", "--checkpoint", "partial/step-00000004")
    card = (run.stage / "README.md").read_text(encoding="utf-8")
    assert "step **4**, an intermediate checkpoint of a run configured for 10 steps" in card
    assert "trained for 4 steps" in card and "trained for 10" not in card


# -- card.sections: a file a config names, read and published -----------------------------------


def refused_sections(name: str, root) -> str:
    with pytest.raises(StageError) as caught:
        read_user_sections(name, root)
    message = str(caught.value)
    assert message.startswith(f"card.sections: {name} ") and "\n" not in message
    return message


def test_card_sections_outside_the_run_folder_are_refused_before_anything_is_read(tmp_path):
    run = tmp_path / "a" / "b" / "run"
    (run / "docs").mkdir(parents=True)
    (run / "docs" / "card.md").write_text("## Intended use\n\nTeaching.\n")
    secret = tmp_path / "secret.md"
    secret.write_text("## Shadow\n\nroot:$6$salt$hash:19000:0:99999:7:::\n")
    assert read_user_sections("docs/card.md", run) == "## Intended use\n\nTeaching.\n"
    assert read_user_sections(str(run / "docs" / "card.md"), run).startswith("## Intended use")
    assert read_user_sections("docs/../docs/card.md", run).startswith("## Intended use")  # stays inside
    assert read_user_sections("", run) is None
    up = "../" * (len(run.parts) + 2) + str(secret).lstrip("/")
    for name in ("../../../secret.md", up, str(secret), "/etc/passwd"):
        assert "is outside the folder the scripts run in" in refused_sections(name, run)
    (run / "linked.md").symlink_to(secret)
    (run / "docs" / "up").symlink_to(tmp_path)
    fix = 'put your sections in a Markdown file inside it and name that file, or set card.sections to ""'
    for name in ("linked.md", "docs/up/secret.md"):
        assert refused_sections(name, run) == (
            f"card.sections: {name} is a link to a file outside the folder the scripts run in ({run}); {fix}"
        )
    assert refused_sections("../../../secret.md", run) == (
        f"card.sections: ../../../secret.md is outside the folder the scripts run in ({run}); {fix}"
    )
    message = refused_sections("/dev/zero", run)
    assert "is outside" in message and 'set card.sections to ""' in message


def test_card_sections_must_be_a_regular_file_of_bounded_size(tmp_path):
    os.mkfifo(tmp_path / "pipe.md")  # opening it to read would wait for a writer forever
    (tmp_path / "folder.md").mkdir()
    (tmp_path / "zero.md").symlink_to("/dev/zero")  # a link inside, to a device outside
    fix = 'put your sections in a Markdown file inside it and name that file, or set card.sections to ""'
    for name in ("pipe.md", "folder.md", ".", "sub/.."):
        assert refused_sections(name, tmp_path) == (
            f"card.sections: {name} is not a regular file (a folder, device or pipe); {fix}"
        )
    assert "is a link to a file outside" in refused_sections("zero.md", tmp_path)
    (tmp_path / "big.md").write_bytes(b"# x\n" * (MAX_SECTIONS // 4) + b"!")
    assert refused_sections("big.md", tmp_path) == (
        f"card.sections: big.md is {MAX_SECTIONS + 1:,} bytes, over the 256 KiB a card's own sections may "
        "have (a card is read by people): shorten it"
    )
    (tmp_path / "big.md").write_bytes(b"# x\n" * (MAX_SECTIONS // 4))  # exactly the limit
    assert len(read_user_sections("big.md", tmp_path)) == MAX_SECTIONS
    (tmp_path / "latin1.md").write_bytes("## Über\n".encode("latin-1"))
    assert refused_sections("latin1.md", tmp_path) == "card.sections: latin1.md is not UTF-8 text"
    # A file named as a folder on the way is not found, as a missing one is: nothing changed while
    # it was read, and a rerun would not help. A name the system cannot take says why.
    (tmp_path / "card.md").write_text("## Use\n")
    for name in ("missing.md", "card.md/more.md", "card.md/sub/more.md"):
        assert refused_sections(name, tmp_path) == (
            f"card.sections: {name} not found (paths are relative to the folder the scripts run in); fix the "
            'path or set card.sections to ""'
        )
    long = "a" * 300 + ".md"
    assert refused_sections(long, tmp_path) == f"card.sections: {long} cannot be read (File name too long)"
    assert refused_sections(f"{long}/card.md", tmp_path) == (
        f"card.sections: {long}/card.md cannot be read (File name too long)"  # too long on the way
    )
    with pytest.raises(StageError) as caught:
        read_user_sections("card.md\0.txt", tmp_path)
    assert str(caught.value) == (
        "card.sections: card.md\\x00.txt is no file name (it holds a NUL byte); put your sections in a "
        'Markdown file inside it and name that file, or set card.sections to ""'
    )


def test_card_sections_are_confined_by_path_components_not_by_a_string_prefix(tmp_path):
    run = tmp_path / "a" / "b"
    (run / "bc").mkdir(parents=True)
    (run / "bc" / "card.md").write_text("## Inside\n")
    sibling = tmp_path / "a" / "bc"  # "/a/bc" starts with the string "/a/b", but is not inside it
    sibling.mkdir()
    (sibling / "card.md").write_text("## Shadow\n")
    for name in ("../bc/card.md", str(sibling / "card.md")):
        assert "is outside the folder the scripts run in" in refused_sections(name, run)
    (run / "sibling.md").symlink_to(sibling / "card.md")
    assert "is a link to a file outside the folder the scripts run in" in refused_sections("sibling.md", run)
    assert read_user_sections("bc/card.md", run) == "## Inside\n"


@pytest.mark.parametrize("swap", ["link", "other"])
def test_card_sections_swapped_after_they_were_looked_at_are_refused_not_followed(
    tmp_path, monkeypatch, swap
):
    import pipeline.stage.card as card_module

    secret = tmp_path / "secret.md"
    secret.write_text("## Shadow\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "card.md").write_text("## Intended use\n")

    class SwapAfterLooking(card_module.HandedFolder):
        def lstat(self, name):
            found = super().lstat(name)
            (run / "card.md").unlink()
            if swap == "link":
                (run / "card.md").symlink_to(secret)
            else:
                (run / "card.md").write_text("## Other\n" * 2)
            return found

    monkeypatch.setattr(card_module, "HandedFolder", SwapAfterLooking)
    assert "changed while it was read; run 05 again" in refused_sections("card.md", run)


def test_05_refuses_card_sections_outside_its_folder_in_one_line_and_keeps_the_stage(staged_run, run_copy):
    run = run_copy(staged_run)
    before = (run.stage / "README.md").read_bytes()
    up = "../" * (len(run.root.parts) + 1) + "etc/passwd"
    for name in (up, "/dev/zero"):
        line = run.refused("05_stage.py", "--set", f"card.sections={name}", timeout=120)
        assert line.startswith(f"error: card.sections: {name} is outside the folder the scripts run in"), line
    assert (run.stage / "README.md").read_bytes() == before
    assert "root:" not in before.decode()


def test_the_card_names_the_launch_and_the_runs_moves_extensions_and_changes_in_step_order(staged_run):
    """From the staged record: the launch that wrote the weights, and (when there is one) the
    history: the first launch, each move, each --extend-to, each accepted environment change."""
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    files = meta["files"]
    assert meta["training"]["launch"] == {
        "parallel": "none",
        "world_size": 1,
        "ddp_find_unused_parameters": None,
    }
    plain = str(build_model_card(meta, files))
    assert "| launch | one process on cpu |" in plain and "| history |" not in plain
    one = {"parallel": "none", "world_size": 1, "ddp_find_unused_parameters": None}
    ddp = {"parallel": "ddp", "world_size": 2, "ddp_find_unused_parameters": False}
    fsdp = {"parallel": "fsdp2", "world_size": 4, "ddp_find_unused_parameters": None}
    meta["training"].update(
        launch=fsdp,
        changes=[
            {"item": "launch", "recorded": one, "now": ddp, "step": 4},
            {"item": "intra_op_threads", "recorded": 1, "now": 2, "step": 4},
            {"item": "launch", "recorded": ddp, "now": fsdp, "step": 12},
        ],
        lineage=[{"from_max_steps": 10, "at_step": 10, "to_max_steps": 20}],
    )
    card = str(build_model_card(meta, files))
    assert "| launch | 4 processes (FSDP2) on cpu |" in card
    assert (
        "| history | trained in one process; moved to 2 processes (DDP) after step 4; intra_op_threads changed "
        "from 1 to 2 after step 4; extended from 10 to 20 steps after step 10; moved to 4 processes (FSDP2) "
        "after step 12 |"
    ) in card


def test_the_launch_row_says_when_ddp_ran_with_find_unused_parameters(staged_run):
    """The launch record's ddp_find_unused_parameters (docs/format.md) changes DDP's reduction
    order: a run with it true is not the same launch as one without, and the row says which."""
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    meta["training"].update(changes=[], lineage=[])
    rows = {}
    for unused in (True, False):
        meta["training"]["launch"] = {
            "parallel": "ddp",
            "world_size": 2,
            "ddp_find_unused_parameters": unused,
        }
        card = str(build_model_card(meta, meta["files"]))
        (rows[unused],) = [line for line in card.splitlines() if line.startswith("| launch |")]
    assert rows[False] == "| launch | 2 processes (DDP) on cpu |", rows
    assert rows[True].startswith("| launch | 2 processes (DDP"), rows
    assert "find_unused_parameters" in rows[True], rows


def test_a_callbacks_stop_reason_is_text_on_the_card_never_html_or_markdown(staged_run):
    """A callback's stop_reason and import path are its words (docs/training.md): on the card they
    are one sentence of text, no tag, comment or link of theirs (a <!-- would hide the rest)."""
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    meta["training"]["stopped"] = {
        "step": 4,
        "by": "mycallbacks:make <script>alert(1)</script>",
        "reason": "loss <img src=x onerror=alert(1)> diverged | ~~struck~~\n## Pwned <!-- [link](http://x)",
    }
    card = str(build_model_card(meta, meta["files"]))
    (line,) = [line for line in card.splitlines() if "It stopped early at step 4:" in line]
    sentence = line[line.index("It stopped early at step 4:") :]
    assert "diverged" in sentence and "Pwned" in sentence and "mycallbacks:make" in sentence, sentence
    assert re.search(r"(?<!\\)[<>|~]", sentence) is None, sentence  # every < > | ~ escaped
    assert re.search(r"(?<!\\)<(img|script|!--)", card) is None and "\n## Pwned" not in card


def test_printable_fence_and_number_at_their_edges():
    """Only C0/C1 controls and lone surrogates are escaped (tab, newline, no-break space, line
    separator and format characters stay); a fence keeps a sample's indentation; numbers keep sign and zero."""
    text = "a\tb\nc\x00\x0b\x1f\x7f\x80\x9f\xa0é\u2028\ud800\U000e0001z"
    assert printable(text) == "a\tb\nc\\x00\\x0b\\x1f\\x7f\\x80\\x9f\xa0é\u2028\\ud800\U000e0001z"
    assert printable("plain ünïcode — text") == "plain ünïcode — text"
    assert fence("  x = 1\n\n", "sh") == "```sh\n  x = 1\n```"
    assert fence("") == "```\n\n```"
    assert fence("a ```` b") == "`````\na ```` b\n`````"
    assert [number(v) for v in (0.0, -0.0, -1.5e-7, 1234567.0)] == ["0", "-0", "-1.5e-07", "1.23457e+06"]


def test_empty_blank_and_control_character_values_on_the_card(staged_run):
    """A blank description, blank own sections and an empty sample are no text of the user's; a
    stop reason's controls are shown as escapes, never as spaces (a final loss of 0: test_card_text)."""
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    plain = str(build_model_card(meta, meta["files"]))
    assert str(build_model_card(meta, meta["files"], user_sections=" \n\t\n", sample="")) == plain
    blank = json.loads(json.dumps(meta))
    blank["config"]["card"]["description"] = " \t\n "
    name = meta["config"]["model"]["name"]
    (described,) = [
        line
        for line in str(build_model_card(blank, meta["files"])).splitlines()
        if line.startswith(f"`{name}` is a")
    ]
    assert described.startswith(
        f"`{name}` is a PyTorch model with {meta['model']['num_parameters']:,} parameters"
    )
    meta["step"] = 12345  # past the planned steps: the last step of its run, stopped early before
    meta["training"]["stopped"] = {"step": 1234, "by": "cb:\x85stop", "reason": "loss\x0bflat\x1c \t_x_\n"}
    (line,) = [
        line for line in str(build_model_card(meta, meta["files"])).splitlines() if "It stopped" in line
    ]
    assert line == (
        f"This is step **12,345**, the last step of its run; {meta['model']['num_parameters']:,} parameters in "
        "`modelo.safetensors`. It stopped early at step 1,234: loss\\\\x0bflat\\\\x1c \\_x\\_ (cb:\\\\x85stop)."
    )


def test_empty_card_fields_stay_out_of_the_front_matter_and_the_first_dataset_is_evaluated(staged_run):
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    card, metrics = meta["config"]["card"], meta["metrics"]
    card.update(language=[], pipeline_tag="", datasets=["org/first", "org/second"], eval_dataset_name="")
    card.update(eval_dataset_type="", library_name="", base_model="", tags=[])
    values = sorted(metrics["values"])
    assert card_data(meta).to_dict() == {
        "datasets": ["org/first", "org/second"],
        "library_name": "pytorch",
        "license": card["license"],
        "metrics": values,
        "tags": [],
        "model-index": [
            {
                "name": meta["config"]["model"]["name"],
                "results": [
                    {
                        "task": {"type": "other", "name": "held-out evaluation"},
                        "dataset": {"name": "org/first", "type": "org/first", "split": metrics["split"]},
                        "metrics": [{"type": n, "value": v, "name": n} for n, v in metrics["values"].items()],
                    }
                ],
            }
        ],
    }
    assert metrics["split"] != "test"  # the split recorded, not a usual name
    # A name set in the card section names the evaluation data even beside training datasets.
    card.update(eval_dataset_name="Held-out rows")
    (result,) = card_data(meta).to_dict()["model-index"][0]["results"]
    assert result["dataset"] == {"name": "Held-out rows", "type": "org/first", "split": metrics["split"]}


def test_a_one_process_torchrun_launch_is_named_and_reproduced_under_torchrun(staged_run):
    """A DDP or FSDP2 run of one process is not a plain one-process run: the card says which,
    and its Reproduce command launches torchrun (02 refuses a DDP record in a plain process)."""
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    for parallel in ("ddp", "fsdp2"):
        launch = {"parallel": parallel, "world_size": 1, "ddp_find_unused_parameters": None}
        meta["training"].update(launch=launch, changes=[], lineage=[])
        card = str(build_model_card(meta, meta["files"]))
        assert f"| launch | one process ({parallel.upper()}) on cpu |" in card, card
        assert (
            "python -m torch.distributed.run --standalone --nproc-per-node 1 scripts/02_train.py "
            "--config config.yaml"
        ) in card, card


def test_the_card_states_the_last_step_the_epochs_and_a_sample_with_backtick_runs_whole(staged_run):
    """Rendered from the staged record: a checkpoint at the run's planned last step is that, not
    an intermediate one; training.epochs is a row of the training table; a sample holding runs
    of backticks stays inside its code block (the fence is longer than any run in it)."""
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    planned = meta["config"]["training"]["max_steps"]
    meta["step"] = planned
    meta["training"]["stopped"] = None
    meta["config"]["training"]["epochs"] = 3
    sample = "print('```')\n```\n````python\nthe end"
    card = str(build_model_card(meta, meta["files"], sample=sample))
    assert f"This is step **{planned:,}**, the last step of its run;" in card, card
    assert "intermediate checkpoint" not in card, card
    assert "| epochs | 3 (`training.epochs`) |" in card, card
    assert f"`````text\n{sample}\n`````\n" in card, card


def _proof_report(passed: list[bool], all_passed: bool, atol: float = 0) -> dict:
    """A completed report of script 03 (the fields the staged verdict reads)."""
    return {
        "all_checks_passed": all_passed,
        "positive": all(passed),
        "negative_divergence_detected": True,
        "checks": {"positive": [{"name": f"check {i}", "passed": ok} for i, ok in enumerate(passed)]},
        "protocol": {"tolerance": {"atol": atol, "rtol": 0}},
        "boundary": {"steps": 8, "cut": 4},
        "components": {"negative": {"rng": {"result": "detected"}, "optimizer": {"result": "detected"}}},
    }


def test_a_resume_proof_that_failed_a_check_is_carded_as_not_proven(staged_run):
    """The card's verdict is the report's all_checks_passed: 3 of 4 checks passed is not proven."""
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    meta["proof"] = proof_verdict(_proof_report([True, True, False, True], all_passed=False))
    card = str(build_model_card(meta, meta["files"]))
    assert "Resuming this training run is **not proven**:" in card, card
    assert "in 3 of 4 checks, bitwise (tolerance 0)" in card, card
    meta["proof"] = proof_verdict(_proof_report([True] * 4, all_passed=True))
    assert "Resuming this training run is **proven**:" in str(build_model_card(meta, meta["files"]))


def test_a_resume_proof_made_with_an_atol_is_carded_with_that_tolerance_not_as_bitwise(staged_run):
    """`03 --atol X` proves a resume within an absolute tolerance X (rtol is always 0): the card
    says so, and never calls such a proof bitwise."""
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    meta["proof"] = proof_verdict(_proof_report([True] * 4, all_passed=True, atol=1e-6))
    card = str(build_model_card(meta, meta["files"]))
    assert "in 4 of 4 checks, absolute tolerance 1e-06." in card, card
    assert "bitwise" not in card.split("## Resume proof", 1)[1].split("\n## ", 1)[0], card


def test_the_reproduce_command_of_an_extended_run_trains_its_first_length_then_extends(staged_run):
    """The schedule depends on max_steps and an extended run's kept its first length: training
    again starts at the planned length, 10, and extends (--extend-to) at the steps listed."""
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    meta["step"] = 20
    meta["config"]["training"]["max_steps"] = 20
    meta["training"]["lineage"] = [{"from_max_steps": 10, "at_step": 10, "to_max_steps": 20}]
    card = str(build_model_card(meta, meta["files"]))
    assert "\npython scripts/02_train.py --config config.yaml --set training.max_steps=10\n" in card, card
    assert "training.max_steps=20" not in card, card
    assert "continue it with `--resume latest --extend-to N` at each step the lineage lists" in card, card
