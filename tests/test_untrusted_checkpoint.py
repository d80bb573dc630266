"""Nothing loaded is trusted unchecked: meta.json is sealed by ``meta_sha256``,
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

from pipeline.checkpoint import LoadMode, load_checkpoint
from pipeline.checkpoint.meta import entry_of
from pipeline.errors import ChecksumMismatch, PipelineError, SchemaMismatch

from support import REPO, one_line_error, read_meta_json, save_parts, write_sealed

STEP = "step-00000010"


@pytest.fixture
def folder(trained_run, tmp_path) -> Path:
    """A private copy of the default run's final checkpoint (``estados_local/step-…``)."""
    root = tmp_path / "estados_local"
    shutil.copytree(trained_run.checkpoint, root / STEP)
    return root / STEP


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
    assert meta["schema"] == "pipeline.checkpoint/3"
    assert meta["meta_sha256"] == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert load_checkpoint(folder, mode=LoadMode.VERIFY).meta == meta


def test_a_value_edit_that_keeps_valid_json_is_refused(folder):
    """The issue's example: the sampler cursor moved by one, nothing else."""
    path = folder / "meta.json"
    text = path.read_text(encoding="utf-8")
    cursor = json.loads(text)["training_state"]["data"]["sampler"]["cursor"]
    edited = text.replace(f'"cursor": {cursor}', f'"cursor": {cursor + 1}', 1)
    assert edited != text
    path.write_text(edited, encoding="utf-8")
    refused(folder, "meta.json", "meta_sha256 does not match", error=ChecksumMismatch)


@pytest.mark.parametrize(
    "reformat",
    [
        lambda text, meta: json.dumps(meta, indent=4, sort_keys=True),
        lambda text, meta: text.rstrip("\n"),  # an editor that drops the final newline
        lambda text, meta: text + "\n",  # or adds one
        lambda text, meta: " " + text,
    ],
    ids=["indent-4", "final-newline-dropped", "newline-added", "leading-space"],
)
def test_a_reformatted_meta_json_with_a_valid_seal_is_refused(folder, reformat):
    """Any byte that is not what the pipeline wrote, even whitespace a JSON reader ignores."""
    path = folder / "meta.json"
    text = path.read_text(encoding="utf-8")
    path.write_text(reformat(text, read_meta_json(folder)), encoding="utf-8")
    assert path.read_text(encoding="utf-8") != text
    refused(folder, "meta.json", "byte for byte", error=ChecksumMismatch)


def test_a_meta_json_read_before_is_checked_again_once_its_bytes_change(folder):
    """A resume reads meta.json twice, and the second read of the same bytes skips the
    byte-level checks; bytes it has not seen are checked in full."""
    assert load_checkpoint(folder, mode=LoadMode.VERIFY).meta["step"] == 10
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


# -- 2. one strict safetensors parser --------------------------------------------------------


def tensor_file(header: dict | bytes, data: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data


def _split(original: bytes) -> tuple[dict, bytes]:
    length = int.from_bytes(original[:8], "little")
    return json.loads(original[8 : 8 + length]), original[8 + length :]


def _by_offset(header: dict) -> list[str]:
    return sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"])


def hostile_variants(original: bytes) -> dict[str, bytes]:
    """Malformed versions of a real safetensors file; each breaks exactly one rule."""
    header, data = _split(original)
    first, second = _by_offset(header)[:2]

    def edited(change) -> bytes:
        copy = json.loads(json.dumps(header))
        change(copy)
        return tensor_file(copy, data)

    def overlap(h):  # the second tensor starts 4 bytes early: it aliases the first; a hole at the end
        h[second]["data_offsets"] = [o - 4 for o in h[second]["data_offsets"]]

    def hole(h):
        h[first]["data_offsets"] = [o + 0 for o in h[first]["data_offsets"]]
        h[second]["data_offsets"] = [o + 4 for o in h[second]["data_offsets"]]

    text = json.dumps(header, separators=(",", ":"))
    escaped = first[:-1] + "\\u%04x" % ord(first[-1])
    duplicate = text[:-1] + f',"{escaped}":' + json.dumps(header[first], separators=(",", ":")) + "}"
    deep = '{"__metadata__":' + "[" * 100_000 + "]" * 100_000 + "}"
    return {
        "overlapping ranges": edited(overlap),
        "a hole between tensors": edited(hole),
        "data not starting at 0": edited(
            lambda h: [
                h[n].__setitem__("data_offsets", [o + 8 for o in h[n]["data_offsets"]]) for n in _by_offset(h)
            ]
        ),
        "trailing bytes": tensor_file(header, data + b"\0" * 8),
        "duplicate name after decoding escapes": tensor_file(duplicate.encode(), data),
        "100k-deep metadata": tensor_file(deep.encode(), data),
        "non-string metadata": edited(lambda h: h.__setitem__("__metadata__", {"format": 1})),
        "a tensor named __metadata__": edited(lambda h: h.__setitem__("__metadata__", h.pop(first))),
        "booleans as offsets": edited(
            lambda h: h.__setitem__(first, {**h[first], "data_offsets": [False, True]})
        ),
        "float dims": edited(
            lambda h: h.__setitem__(first, {**h[first], "shape": [float(d) for d in h[first]["shape"]]})
        ),
        "negative dim": edited(
            lambda h: h.__setitem__(first, {**h[first], "shape": [-1, *h[first]["shape"][1:]]})
        ),
        "shape [0, 2**62, 4]": edited(lambda h: h.__setitem__(first, {**h[first], "shape": [0, 2**62, 4]})),
        "offsets past the end": edited(
            lambda h: h.__setitem__(first, {**h[first], "data_offsets": [0, 2**70]})
        ),
        "unknown dtype": edited(lambda h: h.__setitem__(first, {**h[first], "dtype": "F33"})),
        "header length past the end": (10**6).to_bytes(8, "little") + original[8:],
        "header not an object": tensor_file(b"[]", data),
    }


RULES = {
    "overlapping ranges": "overlaps",
    "a hole between tensors": "hole",
    "data not starting at 0": "byte 0",
    "trailing bytes": "trailing bytes",
    "duplicate name after decoding escapes": "appears twice",
    "100k-deep metadata": "nested too deeply",
    "non-string metadata": "__metadata__ must map strings",
    "a tensor named __metadata__": "__metadata__ must map strings",
    "booleans as offsets": "data_offsets must be",
    "float dims": "shape must be",
    "negative dim": "shape must be",
    "shape [0, 2**62, 4]": "overflows",
    "offsets past the end": "overflows|do not hold|run past",
    "unknown dtype": "unknown dtype",
    "header length past the end": "runs past the end",
    "header not an object": "start with '{'",
}


def test_the_parser_refuses_every_hostile_variant_naming_the_file_and_the_rule(trained_run, tmp_path):
    """Each variant refused by our one parser as a SchemaMismatch naming file and rule; and
    every variant that safetensors' own reader refuses is among them (ours is at least as strict)."""
    import re

    from safetensors import safe_open

    from pipeline.checkpoint import read_tensors

    variants = hostile_variants((trained_run.checkpoint / "modelo.safetensors").read_bytes())
    assert set(variants) == set(RULES)
    official_refuses = []
    for name, raw in variants.items():
        path = tmp_path / f"{len(official_refuses)}-{name.replace(' ', '_')}.safetensors"
        path.write_bytes(raw)
        with pytest.raises(SchemaMismatch) as caught:
            read_tensors(path)
        message = str(caught.value)
        assert str(path) in message and re.search(RULES[name], message), (name, message)
        assert "\n" not in message
        try:
            with safe_open(str(path), "pt") as handle:
                [handle.get_tensor(key) for key in handle.keys()]
        except Exception:  # noqa: BLE001 - any refusal of the official reader counts
            official_refuses.append(name)
    # The reference refuses these too; the rest are the additions.
    assert {
        "overlapping ranges",
        "a hole between tensors",
        "trailing bytes",
        "header length past the end",
        "unknown dtype",
        "non-string metadata",
    } <= set(official_refuses)


def test_a_file_written_by_safetensors_itself_reads_back_identically(tmp_path):
    import torch
    from safetensors.torch import save_file

    from pipeline.checkpoint import read_tensors

    tensors = {
        "f64": torch.randn(3, 2, dtype=torch.float64),
        "bf16": torch.randn(5).bfloat16(),
        "i8": torch.arange(7, dtype=torch.int8),
        "empty": torch.zeros(0, 3),
        "flag": torch.tensor([True]),
    }
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"k": "v"})
    loaded = read_tensors(tmp_path / "x.safetensors")
    assert loaded.keys() == tensors.keys()
    assert all(loaded[k].dtype == v.dtype and torch.equal(loaded[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("mode", [LoadMode.FULL, LoadMode.WEIGHTS])
def test_a_write_to_the_file_after_verification_does_not_reach_the_loaded_tensors(tmp_path, mode):
    """The hashed bytes are the used bytes: the pages were copied before they were hashed.
    Evaluate and stage (``LoadMode.WEIGHTS``) get the weights alone, owned the same way. The
    tensors span many pages past the header's (whose pages are always owned)."""
    import torch

    from pipeline.checkpoint import CheckpointStore

    with CheckpointStore(tmp_path) as store:
        folder = store.save(
            1,
            {"w": torch.randn(65536, dtype=torch.float64)},
            {"s": torch.randn(65536, dtype=torch.float64)},
            save_parts(),
        ).path
    loaded = load_checkpoint(folder, mode=mode)
    assert bool(loaded.state_tensors) is (mode is LoadMode.FULL) and loaded.model_tensors
    owned = {"modelo.safetensors": loaded.model_tensors, "estado_treino.safetensors": loaded.state_tensors}
    before = {file: {name: tensor.clone() for name, tensor in held.items()} for file, held in owned.items()}
    for file in owned:
        path = folder / file
        size = path.stat().st_size
        with open(path, "r+b") as handle:  # a concurrent writer: same size, every data byte changed
            length = int.from_bytes(handle.read(8), "little")
            handle.seek(8 + length)
            handle.write(b"\x7f" * (size - 8 - length))
    for file, held in owned.items():
        assert all(torch.equal(held[name], value) for name, value in before[file].items())


def test_resume_hashes_the_weights_where_it_copied_them_into_the_model(tmp_path):
    """``load_checkpoint(into=model)`` (what resume does) verifies after materialising: the
    parameters receive the weights and their bytes are the ones hashed, so ``model_tensors``
    are the parameters themselves (no second copy), a buffer comes as a fresh tensor (the
    derived-buffer check compares it before it is loaded), a later write to the file
    reaches none of them, and a damaged byte is still refused."""
    import torch

    from pipeline.checkpoint import CheckpointStore, load_model_weights

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(65536, dtype=torch.float64))
            self.v = torch.nn.Parameter(torch.zeros(3, 5))
            self.register_buffer("b", torch.zeros(4096))

    saved = {"w": torch.randn(65536, dtype=torch.float64), "v": torch.randn(3, 5), "b": torch.randn(4096)}
    with CheckpointStore(tmp_path) as store:
        folder = store.save(1, saved, {"s": torch.randn(4096)}, save_parts()).path
    model = Model()
    loaded = load_checkpoint(folder, into=model)
    assert loaded.model_tensors["w"].data_ptr() == model.w.data_ptr()
    assert loaded.model_tensors["v"].data_ptr() == model.v.data_ptr()
    assert loaded.model_tensors["b"].data_ptr() != model.b.data_ptr() and not model.b.any()
    assert all(torch.equal(loaded.model_tensors[name], value) for name, value in saved.items())
    path = folder / "modelo.safetensors"
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    with open(path, "r+b") as handle:  # a concurrent writer: same size, every data byte changed
        handle.seek(8 + length)
        handle.write(b"\x7f" * (len(raw) - 8 - length))
    assert all(torch.equal(loaded.model_tensors[name], value) for name, value in saved.items())
    load_model_weights(model, loaded.model_tensors)
    assert all(torch.equal(tensor, saved[name]) for name, tensor in model.state_dict().items())
    for position in (
        8 + length + 5,
        8 + length + 65536 * 8 + 3,
        len(raw) - 1,
    ):  # in w, in b, in v (file order)
        damaged = bytearray(raw)
        damaged[position] ^= 0x10
        path.write_bytes(damaged)
        with pytest.raises(ChecksumMismatch, match="modelo.safetensors SHA-256 differs"):
            load_checkpoint(folder, into=Model())


def test_weights_stored_in_another_dtype_of_the_same_size_are_not_read_into_the_parameter(tmp_path):
    """A checkpoint whose ``w`` is bfloat16 where the model's parameter is float16 (same
    size, same shape): resume's read into the model must not pour the bf16 bytes into the
    fp16 parameter (the bits reinterpreted); the tensor comes as its own bf16 copy, the
    parameter is untouched, and the strict load refuses it in one line naming it."""
    import torch

    from pipeline.checkpoint import CheckpointStore, load_model_weights
    from pipeline.errors import StateMismatch

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))

    saved = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    with CheckpointStore(tmp_path) as store:
        folder = store.save(1, {"w": saved}, {"s": torch.zeros(1)}, save_parts()).path
    model = Model()
    loaded = load_checkpoint(folder, into=model)
    assert loaded.model_tensors["w"].dtype == torch.bfloat16 and torch.equal(loaded.model_tensors["w"], saved)
    assert not model.w.any()
    with pytest.raises(StateMismatch) as caught:
        load_model_weights(model, loaded.model_tensors)
    message = str(caught.value)
    assert "tensor w is torch.bfloat16" in message and "\n" not in message, message
    assert not model.w.any()


def install_hostile(folder: Path, name: str, raw: bytes) -> None:
    """Replace one file of a checkpoint and rewrite its hash, size and the seal to match."""
    (folder / name).write_bytes(raw)
    meta = read_meta_json(folder)
    meta["files"][name] = entry_of(raw)
    write_sealed(folder, meta)


REWRITTEN = (
    "overlapping ranges",
    "trailing bytes",
    "100k-deep metadata",
    "duplicate name after decoding escapes",
    "negative dim",
    "shape [0, 2**62, 4]",
)


def test_hostile_files_with_rewritten_hashes_are_refused_by_resume_evaluate_and_stage(trained_run, run_copy):
    """In this process (fast), every variant through what 02, 04 and 05 call."""
    from pipeline.config import load_config
    from pipeline.evaluate import evaluate_checkpoint
    from pipeline.stage import build_stage
    from pipeline.train import train

    run = run_copy(trained_run)
    original = {
        n: (run.checkpoint / n).read_bytes()
        for n in ("modelo.safetensors", "estado_treino.safetensors", "meta.json")
    }
    config = load_config(REPO / "config.yaml", {**run.overrides, "training.max_steps": 12})
    for target in ("modelo.safetensors", "estado_treino.safetensors"):
        variants = hostile_variants(original[target])
        for variant in REWRITTEN:
            install_hostile(run.checkpoint, target, variants[variant])
            for consumer in (
                lambda: train(config, resume="latest", progress=False),
                lambda: evaluate_checkpoint(config),
                lambda: build_stage(config, stage_dir=run.stage, with_metrics=False),
            ):
                with pytest.raises(PipelineError) as caught:
                    consumer()
                assert "\n" not in str(caught.value) and target in str(caught.value), (
                    target,
                    variant,
                    caught.value,
                )
            for name, raw in original.items():
                (run.checkpoint / name).write_bytes(raw)
    assert not run.stage.exists()


@pytest.mark.parametrize("script", ["02_train.py", "04_evaluate.py", "05_stage.py"])
def test_a_hostile_file_with_rewritten_hashes_is_one_line_from_each_script(trained_run, run_copy, script):
    run = run_copy(trained_run)
    raw = (run.checkpoint / "modelo.safetensors").read_bytes()
    install_hostile(run.checkpoint, "modelo.safetensors", hostile_variants(raw)["overlapping ranges"])
    args = {
        "02_train.py": ("--quiet", "--resume", "latest", "--max-steps", "12"),
        "05_stage.py": ("--no-metrics",),
    }.get(script, ())
    line = run.refused(script, *args)
    assert "modelo.safetensors" in line and "overlaps" in line


# -- 3. the restored tree is validated before it touches a live object -----------------------


def _set(tree: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for key in parents:
        tree = tree[int(key)] if isinstance(tree, list) else tree[key]
    if isinstance(tree, list):
        tree[int(last)] = value
    else:
        tree[last] = value


def _swap_refs(meta: dict) -> None:
    """Parameter 0's Adam moment points at parameter 1's and the other way round: every
    tensor still used once, but the shapes are another parameter's."""
    pairs = meta["training_state"]["optimizer"]["state"]["__dict__"]
    first, second = pairs[0][1], pairs[1][1]
    first["exp_avg"], second["exp_avg"] = second["exp_avg"], first["exp_avg"]


def _one_parameter_past_the_model(meta: dict) -> None:
    """Parameter 0's Adam state filed under the index one past the model's last parameter
    (every parameter has a state, so their count is the model's)."""
    pairs = meta["training_state"]["optimizer"]["state"]["__dict__"]
    pairs[0][0] = len(pairs)


def _alias(meta: dict) -> None:
    entry = meta["training_state"]["optimizer"]["state"]["__dict__"][0][1]
    entry["exp_avg_sq"] = dict(entry["exp_avg"])


STATE_EDITS = {
    "step as a string": (lambda m: _set(m, "training_state.progress.step", "10"), "progress.step"),
    "step 5.9": (lambda m: _set(m, "training_state.progress.step", 9.9), "progress.step"),
    "step -100": (lambda m: _set(m, "training_state.progress.step", -100), "progress.step"),
    "step 10**4000": (lambda m: _set(m, "training_state.progress.step", 10**4000), "progress.step"),
    "step 9 in a step-10 checkpoint": (lambda m: _set(m, "training_state.progress.step", 9), "progress.step"),
    "NaN learning rate": (
        lambda m: _set(m, "training_state.optimizer.param_groups.0.lr", {"__float__": "nan"}),
        "param_groups[0].lr",
    ),
    "infinite learning rate": (
        lambda m: _set(m, "training_state.optimizer.param_groups.0.lr", {"__float__": "inf"}),
        "param_groups[0].lr",
    ),
    "learning rate as a string": (
        lambda m: _set(m, "training_state.optimizer.param_groups.0.lr", "0.01"),
        "param_groups[0].lr",
    ),
    "param groups as a string": (
        lambda m: _set(m, "training_state.optimizer.param_groups", "x"),
        "param_groups",
    ),
    "one tensor referenced twice": (_alias, "referenced twice"),
    "moments of another parameter's shape": (_swap_refs, "optimizer.state[0].exp_avg"),
    "a state for one parameter more than the model has": (
        _one_parameter_past_the_model,
        "optimizer.state names parameter",
    ),
    "param groups naming the parameters in another order": (
        lambda m: _set(
            m,
            "training_state.optimizer.param_groups.0.params",
            m["training_state"]["optimizer"]["param_groups"][0]["params"][::-1],
        ),
        "optimizer.param_groups[0].params differ from this model's parameters",
    ),
    "a scheduler field more than the scheduler has": (
        lambda m: _set(m, "training_state.scheduler.warmup", 3),
        "scheduler does not have the expected fields (differs at ['warmup'])",
    ),
    "cursor past the data": (lambda m: _set(m, "training_state.data.sampler.cursor", 10**6), "data.sampler"),
    "negative epoch": (lambda m: _set(m, "training_state.data.sampler.epoch", -1), "data.sampler"),
    "scheduler position off the step": (
        lambda m: _set(m, "training_state.scheduler.last_epoch", 3),
        "scheduler.last_epoch",
    ),
    "scheduler field of the wrong type": (
        lambda m: _set(m, "training_state.scheduler.base_lrs", 0.01),
        "scheduler.base_lrs",
    ),
    "a scheduler list one item longer": (
        lambda m: _set(m, "training_state.scheduler.base_lrs", [0.01, 0.01]),
        "scheduler.base_lrs is not a list of 1 items",
    ),
    "a scheduler list one item shorter": (
        lambda m: _set(m, "training_state.scheduler.base_lrs", []),
        "scheduler.base_lrs is not a list of 1 items",
    ),
    "Adam betas of three items": (
        lambda m: _set(m, "training_state.optimizer.param_groups.0.betas", {"__tuple__": [0.9, 0.999, 0.5]}),
        "param_groups[0].betas is not a tuple of 2 items",
    ),
    "broken python RNG state": (
        lambda m: _set(m, "training_state.rng.python", {"__tuple__": [3, [1, 2], None]}),
        "rng.python",
    ),
    "rng family missing": (lambda m: m["training_state"]["rng"].pop("torch_cpu"), "rng"),
    "unknown marker field": (
        lambda m: _set(
            m, "training_state.optimizer.param_groups.0.betas", {"__tuple__": [0.9, 0.999], "x": 1}
        ),
        "malformed",
    ),
    "object dtype array": (
        lambda m: _set(m, "training_state.data.sampler.permutation.dtype", "|O"),
        "permutation",
    ),
}


def test_every_malformed_state_field_is_refused_naming_it_before_anything_is_loaded(trained_run, run_copy):
    """Sealed edits (meta_sha256 recomputed): only validation stands between them and the run."""
    from pipeline.config import load_config
    from pipeline.errors import StateMismatch
    from pipeline.train import train

    run = run_copy(trained_run)
    original = (run.checkpoint / "meta.json").read_bytes()
    config = load_config(REPO / "config.yaml", run.overrides)
    for case, (edit, field) in STATE_EDITS.items():
        meta = json.loads(original)
        edit(meta)
        write_sealed(run.checkpoint, meta)
        with pytest.raises(StateMismatch) as caught:
            train(config, resume="latest", progress=False)
        message = str(caught.value)
        assert field in message and "\n" not in message, (case, message)
    (run.checkpoint / "meta.json").write_bytes(original)
    assert train(config, resume="latest", progress=False).step == 10  # the unedited state passes


def _resealed_state_tensor(run, name: str, edit) -> None:
    """``edit`` one tensor of the run's training-state file in place (same dtype and shape),
    then rewrite the file and re-seal meta.json: only validation stands between it and a resume."""
    from pipeline.checkpoint import read_tensors, write_safetensors

    path = run.checkpoint / "estado_treino.safetensors"
    tensors = {k: v.clone() for k, v in read_tensors(path).items()}
    edit(tensors[name])
    path.unlink()
    write_safetensors(path, tensors)
    meta = read_meta_json(run.checkpoint)
    meta["files"]["estado_treino.safetensors"] = entry_of(path.read_bytes())
    write_sealed(run.checkpoint, meta)


def test_a_permutation_index_outside_the_data_is_refused(trained_run, run_copy):
    import torch

    from pipeline.config import load_config
    from pipeline.errors import StateMismatch
    from pipeline.train import train

    def out_of_range(permutation: torch.Tensor) -> None:
        permutation.view(torch.int64)[0] = 10**6

    run = run_copy(trained_run)
    _resealed_state_tensor(run, "data/sampler/permutation", out_of_range)
    with pytest.raises(StateMismatch, match="permutation"):
        train(load_config(REPO / "config.yaml", run.overrides), resume="latest", progress=False)


def test_a_torch_rng_state_torch_cannot_load_is_one_line_naming_it(trained_run, run_copy):
    """A sealed torch CPU generator state of the right size whose bytes are no valid
    mt19937 state (all zero): torch's set_state raises RuntimeError; the resume refuses it
    in one line naming rng.torch_cpu, before anything is loaded."""
    from pipeline.config import load_config
    from pipeline.errors import StateMismatch
    from pipeline.train import train

    run = run_copy(trained_run)
    _resealed_state_tensor(run, "rng/torch_cpu", lambda t: t.zero_())
    with pytest.raises(StateMismatch) as caught:
        train(load_config(REPO / "config.yaml", run.overrides), resume="latest", progress=False)
    message = str(caught.value)
    assert "rng.torch_cpu is not a valid state (RuntimeError)" in message and "\n" not in message, message


def test_split_state_refuses_two_entries_with_one_name_for_every_leaf_type():
    import numpy as np
    import torch

    from pipeline.checkpoint.codec import split_state

    for leaf in (torch.zeros(1), np.zeros(1)):
        with pytest.raises(ValueError, match="a/b"):
            split_state({"a/b": leaf, "a": {"b": leaf}}, "s", {})
        with pytest.raises(ValueError, match="a/b"):
            split_state({"a": {"b": leaf}, "a/b": leaf}, "s", {})


def test_a_sealed_state_edit_is_one_line_from_the_real_script(trained_run, run_copy):
    run = run_copy(trained_run)
    meta = read_meta_json(run.checkpoint)
    meta["training_state"]["progress"]["step"] = "10"
    write_sealed(run.checkpoint, meta)
    line = run.refused("02_train.py", "--quiet", "--resume", "latest")
    assert "progress.step" in line


# -- 4. resume is exact across environments, or refused ----------------------------------------


def test_every_checkpoint_records_what_changes_the_numbers(trained_run):
    import numpy as np
    import torch

    environment = read_meta_json(trained_run.checkpoint)["environment"]
    assert environment == {
        **environment,
        "intra_op_threads": 1,
        "deterministic_algorithms": True,
        "device_type": "cpu",
        "torch": torch.__version__,
        "numpy": np.__version__,
        "changes": [],
    }
    assert type(environment["inter_op_threads"]) is int


@pytest.fixture(scope="module")
def stopped_run(data_dir, tmp_path_factory):
    """The default config stopped after step 5 of 10 (read-only: copy it)."""
    from conftest import RunFolder

    run = RunFolder(tmp_path_factory.mktemp("stopped_run"))
    shutil.copytree(data_dir, run.data_dir)
    run.ok("02_train.py", "--quiet", "--stop-at", "5")
    return run


def test_an_environment_that_cannot_be_reproduced_is_refused_unless_allowed(stopped_run, run_copy):
    """A recorded item this process cannot match (another torch version here) is named; with
    the flag the resume goes on and the change is recorded in every later checkpoint."""
    from pipeline.config import load_config
    from pipeline.errors import EnvironmentMismatch
    from pipeline.train import train

    run = run_copy(stopped_run)
    meta = read_meta_json(run.checkpoint)
    meta["environment"]["torch"] = "1.0.0"
    write_sealed(run.checkpoint, meta)
    with pytest.raises(EnvironmentMismatch, match=r"torch \('1.0.0' recorded"):
        train(load_config(REPO / "config.yaml", run.overrides), resume="latest", progress=False)
    line = run.refused("02_train.py", "--quiet", "--resume", "latest")
    assert "torch" in line and "--allow-environment-change" in line
    result = run.ok("02_train.py", "--resume", "latest", "--allow-environment-change")
    assert "no longer bitwise" in result.stderr + result.stdout
    import torch

    changes = read_meta_json(run.checkpoint)["environment"]["changes"]
    assert run.checkpoint.name == "step-00000010"
    assert changes == [{"item": "torch", "recorded": "1.0.0", "now": torch.__version__, "step": 5}]


@pytest.mark.heavy
def test_charlm_cut_with_one_thread_and_resumed_with_two_is_bitwise_the_one_thread_run(tmp_path):
    """The issue's acceptance: OMP_NUM_THREADS=1 for the cut, 2 for the resume. A control run
    pinned to 2 threads differs from the 1-thread run, so the equality is not luck."""
    from support import assert_checkpoints_bitwise_equal, run_script, script_env

    config = str(REPO / "examples" / "charlm" / "config.yaml")
    common = [
        "--config",
        config,
        "--set",
        f"data.dir={tmp_path / 'data'}",
        "--set",
        "training.max_steps=6",
        "--set",
        "data.params.max_chars=20000",
        "--quiet",
    ]

    def script(name: str, threads: str, *args: str):
        result = run_script(
            name,
            *common[:-1] if name == "01_prepare_data.py" else common,
            *args,
            env=script_env(OMP_NUM_THREADS=threads),
        )
        assert result.returncode == 0, result.stderr

    script("01_prepare_data.py", "1")
    script("02_train.py", "1", "--checkpoint-dir", str(tmp_path / "straight"))
    script("02_train.py", "1", "--checkpoint-dir", str(tmp_path / "cut"), "--stop-at", "3")
    script("02_train.py", "2", "--checkpoint-dir", str(tmp_path / "cut"), "--resume", "latest")
    assert_checkpoints_bitwise_equal(
        tmp_path / "straight" / "step-00000006", tmp_path / "cut" / "step-00000006"
    )
    script("02_train.py", "2", "--checkpoint-dir", str(tmp_path / "two"), "--set", "training.threads=2")
    with pytest.raises(AssertionError, match="tensors differ"):
        assert_checkpoints_bitwise_equal(
            tmp_path / "straight" / "step-00000006", tmp_path / "two" / "step-00000006"
        )


# -- 5. the printed resume command is the one to run --------------------------------------------


@pytest.mark.heavy
def test_the_resume_command_printed_on_sigterm_finishes_that_run_bitwise(data_dir, tmp_path):
    """Started with its own --config, a relative --checkpoint-dir and --set overrides; the
    printed line, run as printed from the same folder, ends bitwise equal to a straight run."""
    import shlex
    import signal
    import subprocess

    from pipeline.checkpoint import CheckpointStore

    from support import PYTHON, assert_checkpoints_bitwise_equal, run_python, script_env, verify_checkpoint

    (tmp_path / "my config.yaml").write_text((REPO / "config.yaml").read_text())
    args = [
        "--config",
        "my config.yaml",
        "--set",
        f"data.dir={data_dir}",
        "--set",
        "training.max_steps=300",
        "--set",
        "checkpoint.every=1000",
    ]
    script = str(REPO / "scripts" / "02_train.py")
    straight = run_python(
        [script, *args, "--checkpoint-dir", "runs/straight", "--quiet"], cwd=tmp_path, env=script_env()
    )
    assert straight.returncode == 0, straight.stderr
    process = subprocess.Popen(
        [PYTHON, script, *args, "--checkpoint-dir", "runs/x"],
        cwd=tmp_path,
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in process.stderr:
        if line.startswith("step 2/"):
            break
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr, stderr
    stopped = CheckpointStore(tmp_path / "runs/x").committed_steps()
    assert len(stopped) == 1 and 2 <= stopped[0] < 300, stopped  # the step it stopped after, saved
    verify_checkpoint(tmp_path / "runs/x" / f"step-{stopped[0]:08d}")
    printed = stderr.split("Resume with: ", 1)[1].strip()
    assert "--checkpoint-dir runs/x" in printed and "'my config.yaml'" in printed
    resumed = subprocess.run(
        shlex.split(printed), cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    assert_checkpoints_bitwise_equal(
        tmp_path / "runs/straight/step-00000300", tmp_path / "runs/x/step-00000300"
    )


# -- 6. stale derived buffers are refused -----------------------------------------------------


def test_a_derived_buffer_whose_code_changed_is_refused_on_resume_evaluate_and_stage(data_dir, tmp_path):
    """``scale`` is built from a code constant; ``bn``'s statistics are trained. Edit the
    constant after the save: resume, evaluate and stage refuse naming the changed file, and a
    resume that accepts the change still refuses ``scale``; with the constant unchanged all of
    them accept the trained statistics."""
    from conftest import RunFolder

    run = RunFolder(tmp_path)
    module = tmp_path / "scaled_factories.py"
    module.write_text((Path(__file__).parent / "helpers" / "buffer_factories.py").read_text())
    args = (
        "--set",
        f"data.dir={data_dir}",
        "--set",
        "model.factory=scaled_factories:build_model",
        "--set",
        "training.max_steps=6",
    )
    run.ok("02_train.py", *args, "--quiet", "--stop-at", "4")
    derived = read_meta_json(run.checkpoint)["model"]["derived_buffers"]
    assert "scale" in derived and not any(name.startswith("bn.") for name in derived)
    run.ok("04_evaluate.py", *args)  # unchanged code: the trained BatchNorm statistics load
    module.write_text(module.read_text().replace("SCALE = 1.0", "SCALE = 2.0"))
    # Resume, evaluate and stage name the changed file first (the code a checkpoint counts);
    # accepted on purpose, the resume still refuses the buffer this code no longer builds.
    for script, extra in (
        ("02_train.py", ("--quiet", "--resume", "latest")),
        ("04_evaluate.py", ()),
        ("05_stage.py", ("--no-metrics",)),
    ):
        line = run.refused(script, *args, *extra)
        assert "scaled_factories.py (the model's code) changed since step 4" in line, (script, line)
    line = run.refused("02_train.py", *args, "--quiet", "--resume", "latest", "--allow-environment-change")
    assert "buffer scale" in line and "code or config that builds it changed" in line, line
    module.write_text(module.read_text().replace("SCALE = 2.0", "SCALE = 1.0"))
    run.ok("02_train.py", *args, "--quiet", "--resume", "latest")
