"""Weights that do not fit the model are refused by every reader, one check for all; tensor
names are printable ASCII; what a stage may hold: no file above the Hub's maximum, the
model's code closure only (never the data factory, of this project only pipeline.params),
the user's own card sections (scanned with the rest)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from test_untrusted_checkpoint import _split, install_hostile, tensor_file

from pipeline.checkpoint import (
    MappedTensors,
    check_weights_fit,
    read_tensors,
    write_safetensors,
    write_safetensors_streamed,
)
from pipeline.config import load_config
from pipeline.errors import InternalError, PipelineError, SchemaMismatch, StageError, StateMismatch
from pipeline.evaluate import evaluate_checkpoint
from pipeline.sources import model_sources
from pipeline.stage import StageBuild, build_stage
from pipeline.stage.weights import HUB_MAX_FILE_SIZE, parse_size, plan_weights

from support import REPO, read_meta_json, write_sealed

FIT = "does not fit the configured model"


def rename_tensor(raw: bytes, old: str, new: str) -> bytes:
    """The same file with one tensor under another name (same bytes, same place)."""
    header, data = _split(raw)
    header[new] = header.pop(old)
    return tensor_file(header, data)


@pytest.fixture
def renamed(trained_run, run_copy):
    """A checkpoint whose weights file has one tensor renamed, hashes and seal recomputed."""
    run = run_copy(trained_run)
    raw = (run.checkpoint / "modelo.safetensors").read_bytes()
    install_hostile(run.checkpoint, "modelo.safetensors", rename_tensor(raw, "net.0.weight", "net.0.weights"))
    return run


def test_05_refuses_a_renamed_tensor_in_one_line_and_stages_nothing_like_04(renamed):
    line = renamed.refused("05_stage.py", "--no-metrics")
    assert FIT in line and "net.0.weight" in line and "modelo.safetensors" in line
    assert not renamed.stage.exists()
    # The same check, the same words, where evaluate loads the weights.
    config = load_config(REPO / "config.yaml", renamed.overrides)
    with pytest.raises(StateMismatch, match=FIT):
        evaluate_checkpoint(config)


def test_a_model_record_that_disagrees_with_the_weights_is_refused_by_the_stage(trained_run, run_copy):
    run = run_copy(trained_run)
    config = load_config(REPO / "config.yaml", run.overrides)
    meta = read_meta_json(run.checkpoint)
    meta["model"]["tensors"]["net.0.bias"]["shape"] = [17]
    write_sealed(run.checkpoint, meta)
    with pytest.raises(
        StateMismatch, match=r"does not fit the model recorded in meta.json \(tensor net.0.bias\)"
    ):
        build_stage(config, StageBuild(stage_dir=run.stage, with_metrics=False))
    with pytest.raises(
        StateMismatch, match=r"does not fit the model recorded in meta.json \(tensor net.0.bias\)"
    ):
        evaluate_checkpoint(config)  # the same check where 04 loads the weights
    meta["model"]["tensors"]["net.0.bias"]["shape"] = [16]
    meta["model"]["tied"] = ["net.0.weight"]
    write_sealed(run.checkpoint, meta)
    with pytest.raises(StateMismatch, match="tied weights"):
        build_stage(config, StageBuild(stage_dir=run.stage, with_metrics=False))
    assert not run.stage.exists()


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_must_be_stored_once_under_the_kept_name():
    model = Tied()
    weight = model.embed.weight.detach()
    assert check_weights_fit(model, {"embed.weight": weight}) == {"head.weight": "embed.weight"}
    with pytest.raises(StateMismatch, match=r"unexpected 1 \(head.weight\)"):
        check_weights_fit(model, {"embed.weight": weight, "head.weight": weight})
    with pytest.raises(StateMismatch, match=r"missing 1 \(embed.weight\); unexpected 1 \(head.weight\)"):
        check_weights_fit(model, {"head.weight": weight})
    with pytest.raises(StateMismatch, match=r"tensor embed.weight is torch.float64"):
        check_weights_fit(model, {"embed.weight": weight.double()})
    # Built without weights (parameters on meta), the tie is still seen, and meta tensors stand for the file's.
    skeleton = Tied()
    skeleton.embed.weight = torch.nn.Parameter(torch.empty(5, 3, device="meta"))
    skeleton.head.weight = skeleton.embed.weight  # a tie between parameters without storage: one object
    spec = torch.empty(5, 3, device="meta")
    record = {"tensors": {"embed.weight": {"dtype": "float32", "shape": [5, 3]}}, "tied": ["head.weight"]}
    assert check_weights_fit(skeleton, {"embed.weight": spec}, record=record) == {
        "head.weight": "embed.weight"
    }
    with pytest.raises(StateMismatch, match="tied weights"):
        check_weights_fit(skeleton, {"embed.weight": spec}, record={**record, "tied": []})


@pytest.mark.parametrize("name", ["net.0.\u202eweight", "net.0.weight\x00", "net.\u200b0.weight", ""])
def test_a_tensor_name_with_a_control_bidi_or_invisible_character_is_refused_reading_and_writing(
    trained_run, tmp_path, name
):
    raw = (trained_run.checkpoint / "modelo.safetensors").read_bytes()
    path = tmp_path / "renamed.safetensors"
    path.write_bytes(rename_tensor(raw, "net.0.weight", name))
    with pytest.raises(SchemaMismatch, match="is not printable ASCII"):
        read_tensors(path)
    with pytest.raises(ValueError, match="is not printable ASCII"):
        write_safetensors(tmp_path / "written.safetensors", {name: torch.zeros(2)})
    assert not (tmp_path / "written.safetensors").exists()


def test_the_streamed_writer_writes_the_bytes_of_the_one_writer_one_tensor_at_a_time(tmp_path):
    tensors = {
        "b": torch.arange(6, dtype=torch.float64).view(2, 3),
        "a": torch.ones(5, dtype=torch.int8),
        "c": torch.zeros(0, 4),
        "d": torch.full((3,), 7, dtype=torch.bfloat16),
    }
    expected = write_safetensors(tmp_path / "whole.safetensors", tensors, {"format": "pt"})
    specs = {name: torch.empty_like(t, device="meta") for name, t in tensors.items()}
    asked = []
    streamed = write_safetensors_streamed(
        tmp_path / "streamed.safetensors",
        specs,
        lambda name: asked.append(name) or tensors[name],
        {"format": "pt"},
    )
    assert streamed == expected and asked == ["b", "c", "d", "a"]  # widest first, as the header orders them
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    mapped = MappedTensors(tmp_path / "streamed.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(mapped.tensor(name), tensor)
        mapped.release(name)
        assert torch.equal(mapped.tensor(name), tensor), "a released page reads the file again"
    with pytest.raises(InternalError, match="came as"):
        write_safetensors_streamed(tmp_path / "wrong.safetensors", specs, lambda name: torch.zeros(1))


def _specs(**sizes: int) -> dict[str, torch.Tensor]:
    return {name: torch.empty(size, dtype=torch.uint8, device="meta") for name, size in sizes.items()}


def test_no_planned_file_exceeds_the_hubs_maximum_a_tensor_above_it_is_refused_by_name():
    with pytest.raises(StageError, match=r"tensor layers.7.w is 50,000,000,001 bytes.*per-file maximum"):
        plan_weights(_specs(**{"layers.7.w": HUB_MAX_FILE_SIZE + 1, "small": 10}), {}, parse_size("5GB"))
    with pytest.raises(StageError, match="pass --max-shard-size 50GB or less"):
        plan_weights(_specs(a=30 * 10**9, b=30 * 10**9), {}, parse_size("100GB"))
    plan = plan_weights(_specs(a=30 * 10**9, b=30 * 10**9, c=10), {}, parse_size("50GB"))
    assert len(plan.files) == 2 and plan.total_size == 60 * 10**9 + 10


def _package(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_only_the_model_closure_ships_and_model_code_needing_the_pipeline_or_the_data_module_is_refused(
    tmp_path, monkeypatch
):
    _package(
        tmp_path,
        {
            "mine/__init__.py": "",
            "mine/layers.py": "import torch\n",
            "mine/model.py": """
            from typing import TYPE_CHECKING
            from pipeline.params import read_params
            from .layers import torch
            if TYPE_CHECKING:
                from pipeline.config import Config
            try:
                import not_installed_anywhere
            except ImportError:
                not_installed_anywhere = None
            """,
            "mine/data.py": "from pipeline.checkpoint import read_tensors\n",
            "mine/bad_model.py": "from .data import read_tensors\n",
            "mine/internal_model.py": "from pipeline.config import Config\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    project = REPO / "pipeline"
    shipped = model_sources(
        "mine.model", tmp_path, project_root=project, data_modules=frozenset({"mine.data"})
    )
    assert sorted(shipped) == [
        "mine/__init__.py",
        "mine/layers.py",
        "mine/model.py",
        "pipeline/__init__.py",
        "pipeline/params.py",
    ]
    with pytest.raises(StageError, match=r"\(mine.bad_model\) imports mine.data, the data factory's module"):
        model_sources("mine.bad_model", tmp_path, project_root=project, data_modules=frozenset({"mine.data"}))
    with pytest.raises(StageError, match=r"imports pipeline.config, which is not published with it"):
        model_sources("mine.internal_model", tmp_path, project_root=project)


def test_the_users_card_sections_are_in_the_card_and_scanned_like_every_staged_file(
    evaluated_run, run_copy, monkeypatch
):
    run = run_copy(evaluated_run)
    (run.root / "card.md").write_text(
        "## Intended use\n\nTeaching exact resume.\n\n## Limitations\n\nNone known.\n"
    )
    config = load_config(REPO / "config.yaml", {**run.overrides, "card.sections": "card.md"})
    monkeypatch.chdir(run.root)  # paths in the config are relative to where the scripts run
    build_stage(config, StageBuild(stage_dir=run.stage, metrics=run.metrics))
    card = (run.stage / "README.md").read_text()
    assert (
        card.index("## Intended use") < card.index("## How to load it") and "Teaching exact resume." in card
    )
    assert json.loads((run.stage / "meta.json").read_text())["config"]["card"]["sections"] == "card.md"

    def files() -> dict[str, bytes]:
        return {
            p.relative_to(run.stage).as_posix(): p.read_bytes() for p in run.stage.rglob("*") if p.is_file()
        }

    before = files()
    (run.root / "card.md").write_text("## Contact\n\nhf_" + "a1B2" * 10 + "\n")
    with pytest.raises(PipelineError, match="README.md") as caught:
        build_stage(config, StageBuild(stage_dir=run.stage, metrics=run.metrics))
    assert "a1B2" not in str(caught.value)
    assert files() == before, "the previous stage is untouched"
    (run.root / "card.md").unlink()
    with pytest.raises(StageError, match="card.sections: card.md not found"):
        build_stage(config, StageBuild(stage_dir=run.stage, metrics=run.metrics))


class _Buffered(torch.nn.Module):
    """Four weights and a derived buffer (built from code, never trained) and a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 2)
        self.register_buffer("scale", torch.arange(3.0))


def test_weights_that_do_not_fit_name_the_first_three_names_and_the_record_names_the_tensor_it_differs_at():
    from pipeline.checkpoint.weights import model_summary

    model = _Buffered()
    stored = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    three = {k: v for k, v in stored.items() if k not in ("a.weight", "a.bias", "b.weight")}
    with pytest.raises(StateMismatch) as caught:
        check_weights_fit(model, three)
    assert str(caught.value) == (
        "modelo.safetensors does not fit the configured model: missing 3 (a.bias, a.weight, b.weight)"
    )
    four = {k: v for k, v in stored.items() if k not in ("a.weight", "a.bias", "b.weight", "b.bias")}
    with pytest.raises(StateMismatch) as caught:
        check_weights_fit(model, {**four, "x": stored["scale"]}, source="w.safetensors")
    assert str(caught.value) == (
        "w.safetensors does not fit the configured model: missing 4 (a.bias, a.weight, b.bias, ...); "
        "unexpected 1 (x)"
    )
    record = model_summary(model, {"scale": torch.arange(3.0)})
    assert record == {
        "derived_buffers": ["scale"],
        "tensors": {
            "a.bias": {"dtype": "float32", "shape": [3]},
            "a.weight": {"dtype": "float32", "shape": [3, 3]},
            "b.bias": {"dtype": "float32", "shape": [2]},
            "b.weight": {"dtype": "float32", "shape": [2, 3]},
            "embed.weight": {"dtype": "float32", "shape": [5, 3]},
            "scale": {"dtype": "float32", "shape": [3]},
        },
        "tied": ["head.weight"],
        "num_parameters": 15 + 12 + 8,
    }
    assert model_summary(model, {"scale": torch.ones(3)})["derived_buffers"] == []
    assert check_weights_fit(model, stored, record=record) == {"head.weight": "embed.weight"}
    edited = {**record, "tensors": {**record["tensors"], "b.bias": {"dtype": "float32", "shape": [3]}}}
    with pytest.raises(StateMismatch) as caught:
        check_weights_fit(model, stored, record=edited)
    assert str(caught.value) == (
        "modelo.safetensors does not fit the model recorded in meta.json (tensor b.bias): the checkpoint "
        "is damaged or was edited"
    )
    for malformed in ({**record, "tensors": []}, {**record, "tied": {}}, [record]):
        with pytest.raises(StateMismatch) as caught:
            check_weights_fit(model, stored, record=malformed)
        assert str(caught.value) == (
            "modelo.safetensors: the model record in meta.json is malformed: the checkpoint is sealed but "
            "does not fit this code (another version wrote it, or it was edited and resealed)"
        )


def test_a_derived_buffer_must_equal_this_codes_value_in_shape_dtype_and_bits_before_anything_loads():
    from pipeline.checkpoint import load_model_weights
    from pipeline.checkpoint.weights import check_derived_buffers

    model = _Buffered()
    stored = {k: v.clone() for k, v in model.state_dict().items() if k != "head.weight"}
    check_derived_buffers(model, stored, ["scale"])
    check_derived_buffers(model, stored, [])
    changed = "buffer scale differs from the value this code builds (the code or config that builds it"
    for odd in (torch.arange(3.0) + 1, torch.arange(4.0), torch.arange(3.0).double()):
        with pytest.raises(StateMismatch) as caught:
            check_derived_buffers(model, {**stored, "scale": odd}, ["scale"], source="m.safetensors")
        assert str(caught.value) == (
            f"m.safetensors: {changed} changed since the checkpoint was saved); restore that code, or start "
            "a new run"
        )
    skeleton = _Buffered().to("meta")
    with pytest.raises(StateMismatch) as caught:
        check_derived_buffers(skeleton, stored, ["scale"])
    assert str(caught.value).startswith(f"modelo.safetensors: {changed}")
    for malformed in ("scale", ["nothing"], [1]):
        with pytest.raises(StateMismatch) as caught:
            check_derived_buffers(model, stored, malformed)
        assert str(caught.value) == (
            "modelo.safetensors: the derived-buffer list in meta.json is malformed: the checkpoint is sealed "
            "but does not fit this code (another version wrote it, or it was edited and resealed)"
        )
    # The load checks them before it sets anything: the model keeps its own weights.
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trained = {k: v + 1 for k, v in stored.items()}
    with pytest.raises(StateMismatch, match="buffer scale differs"):
        load_model_weights(model, trained, derived=["scale"])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    load_model_weights(model, trained, derived=[])
    assert torch.equal(model.head.weight, trained["embed.weight"]) and model.head.weight is model.embed.weight


def test_warm_start_copies_what_fits_and_reports_every_other_name_both_ways():
    from pipeline.checkpoint import warm_start

    source = _Buffered()
    target = torch.nn.Sequential()
    target.embed = torch.nn.Embedding(5, 3)
    target.a = torch.nn.Linear(3, 4)
    target.b = torch.nn.Linear(2, 3)  # a weight of the source's size, transposed
    target.c = torch.nn.Linear(1, 1)
    with torch.no_grad():
        target.embed.weight.zero_()
    given = {**source.state_dict(), "embed.weight": source.embed.weight.detach().double()}
    report = warm_start(target, given)
    assert report == {
        "loaded": ["embed.weight"],
        "skipped": [
            "a.weight (shape (3, 3) vs (4, 3))",
            "a.bias (shape (3,) vs (4,))",
            "b.weight (shape (2, 3) vs (3, 2))",
            "b.bias (shape (2,) vs (3,))",
            "head.weight (not in the model)",
            "scale (not in the model)",
        ],
        "new": ["c.weight", "c.bias"],
    }
    assert target.embed.weight.dtype == torch.float32
    assert torch.equal(target.embed.weight, source.embed.weight)
