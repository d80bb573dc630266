"""Nothing loaded is trusted unchecked (issue 10): meta.json is sealed by ``meta_sha256``,
safetensors files are parsed strictly, and the restored state is validated before it
touches a live object. Most cases run in this process through the one loader (fast); a
few go through the real scripts for the one-line error and the exit code."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest

from pipeline.checkpoint import load_checkpoint
from pipeline.checkpoint.store import meta_sha256
from pipeline.errors import ChecksumMismatch, PipelineError, SchemaMismatch

from support import one_line_error

STEP = "step-00000010"


@pytest.fixture
def folder(trained_run, tmp_path) -> Path:
    """A private copy of the default run's final checkpoint (``estados_local/step-…``)."""
    root = tmp_path / "estados_local"
    shutil.copytree(trained_run.checkpoint, root / STEP)
    return root / STEP


def read_meta_json(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text(encoding="utf-8"))


def write_sealed(folder: Path, meta: dict) -> None:
    """What an attacker or a careless edit does: change meta.json and recompute the seal,
    in the exact layout the pipeline writes."""
    meta = {k: v for k, v in meta.items() if k != "meta_sha256"}
    meta["meta_sha256"] = meta_sha256(meta)
    (folder / "meta.json").write_bytes((json.dumps(meta, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def refused(folder: Path, *fragments: str, error: type[PipelineError] = PipelineError) -> str:
    with pytest.raises(error) as caught:
        load_checkpoint(folder)
    message = str(caught.value)
    assert "\n" not in message and caught.value.exit_code == 2
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# -- 1. meta.json covers itself --------------------------------------------------------------

def test_the_seal_is_the_three_lines_of_the_readme(folder):
    meta = read_meta_json(folder)
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    assert meta["schema"] == "pipeline.checkpoint/2"
    assert meta["meta_sha256"] == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert load_checkpoint(folder, tensors=False).meta == meta


def test_a_value_edit_that_keeps_valid_json_is_refused(folder):
    """The issue's example: the sampler cursor moved by one, nothing else."""
    path = folder / "meta.json"
    text = path.read_text(encoding="utf-8")
    cursor = json.loads(text)["training_state"]["data"]["sampler"]["cursor"]
    edited = text.replace(f'"cursor": {cursor}', f'"cursor": {cursor + 1}', 1)
    assert edited != text
    path.write_text(edited, encoding="utf-8")
    refused(folder, "meta.json", "meta_sha256 does not match", error=ChecksumMismatch)


def test_a_reformatted_meta_json_with_a_valid_seal_is_refused(folder):
    meta = read_meta_json(folder)
    (folder / "meta.json").write_text(json.dumps(meta, indent=4, sort_keys=True), encoding="utf-8")
    refused(folder, "meta.json", "byte for byte", error=ChecksumMismatch)


def test_a_duplicate_key_is_refused_even_with_a_valid_seal(folder):
    path = folder / "meta.json"
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace('"step": 10,', '"step": 10,\n "step": 10,', 1), encoding="utf-8")
    refused(folder, "meta.json", "not valid JSON", error=SchemaMismatch)


def test_a_checkpoint_from_before_the_seal_gets_one_clear_line(folder):
    meta = read_meta_json(folder)
    del meta["meta_sha256"]
    meta["schema"] = "pipeline.checkpoint/1"
    (folder / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    message = refused(folder, "predates the meta.json checksum", "--init-from", error=SchemaMismatch)
    assert str(folder / "modelo.safetensors") in message


def test_deeply_nested_meta_json_is_refused_without_recursion_error(folder):
    (folder / "meta.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    refused(folder, "meta.json", "not valid JSON", error=SchemaMismatch)


def test_random_single_byte_changes_anywhere_in_a_checkpoint_are_all_refused(folder):
    """>= 60 random positions over the three files, each a random new byte value: every one is
    refused by the loader (hashes, seal, exact form), none is loaded, none raises anything else."""
    chooser = random.Random(10)
    names = ["meta.json", "modelo.safetensors", "estado_treino.safetensors"]
    originals = {name: (folder / name).read_bytes() for name in names}
    outcomes = []
    for trial in range(90):
        name = names[trial % 3]
        data = bytearray(originals[name])
        position = chooser.randrange(len(data))
        data[position] = (data[position] + chooser.randrange(1, 256)) % 256
        (folder / name).write_bytes(bytes(data))
        try:
            load_checkpoint(folder)
        except PipelineError as exc:
            assert "\n" not in str(exc) and exc.exit_code == 2
            outcomes.append(type(exc).__name__)
        else:
            pytest.fail(f"{name}: byte {position} changed and the checkpoint still loaded")
        finally:
            (folder / name).write_bytes(originals[name])
    assert len(outcomes) == 90
    load_checkpoint(folder)  # the restored originals load: the refusals were the damage's


def test_a_flipped_meta_byte_is_refused_by_the_real_script(trained_run, run_copy):
    run = run_copy(trained_run)
    path = run.checkpoint / "meta.json"
    data = bytearray(path.read_bytes())
    position = data.index(b",", data.index(b'"cursor": ')) - 1  # the number's last digit
    data[position] ^= 0x01  # a digit stays a digit: still valid JSON
    path.write_bytes(bytes(data))
    line = one_line_error(run.script("02_train.py", "--quiet", "--resume", "latest", "--max-steps", "12"))
    assert "meta.json" in line and "meta_sha256" in line
