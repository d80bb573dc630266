"""05 --from-folder: a model folder another tool wrote, staged strictly and published by 06 unchanged.

A tiny GPT-2 and its tokenizer written by transformers' save_pretrained go through the real
scripts 05 and 06 to the loopback Hub and load with AutoModelForCausalLM in a process that
cannot import this project; every way the issue names of a bad folder is refused in one
line, with nothing staged and the previous stage untouched; pickles are never opened.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from huggingface_hub import HfApi, ModelCard, PyTorchModelHubMixin
from safetensors.torch import load_file, save_file
from test_leaks import SAMPLES

from localhub import LocalHub
from pipeline.audit import audit_stage
from pipeline.errors import NonFiniteWeights, PipelineError, SecretInStage, StageError
from pipeline.integrations.seal import seal_checkpoint
from pipeline.leaks import leak_rules
from pipeline.stage.build import StageResult
from pipeline.stage.from_folder import FolderStage, folder_config, stage_folder

from support import first_python_block, one_line_error, publish_stage, run_as_hub_user, run_script, script_env

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("from-folder")

REPO_ID = "test/tiny-gpt2"
TOKEN = f"gpt2-{secrets.token_hex(8)}"
WORDS = ["[UNK]", "hello", "world", "to", "be", "or", "not"]
# Built by concatenation so this file itself never holds a token-shaped string.
FAKE_TOKEN = "hf_" + "Zq7" * 12


def save_gpt2(folder: Path, **save: object) -> None:
    """A tiny GPT-2 (tied embedding) and a word-level tokenizer, as save_pretrained writes them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=len(WORDS), n_positions=16, bos_token_id=0, eos_token_id=0
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(folder, **save)
    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(folder)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("saved") / "tiny-gpt2"
    save_gpt2(folder)
    return folder


@pytest.fixture
def folder(gpt2, tmp_path) -> Path:
    """A copy of the saved folder, to damage."""
    return Path(shutil.copytree(gpt2, tmp_path / "tiny-gpt2"))


def stage(folder: Path, target: Path, **options) -> StageResult:
    return stage_folder(folder_config({}), FolderStage(folder=folder, stage_dir=target, **options))


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- the acceptance path: save_pretrained -> 05 -> 06 -> from_pretrained ------------------------


def test_a_save_pretrained_folder_goes_05_06_in_one_commit_and_loads_with_every_tensor_equal(gpt2, tmp_path):
    target = tmp_path / "stage"
    result = run_script(
        "05_stage.py",
        "--from-folder",
        str(gpt2),
        "--stage",
        str(target),
        "--repo-id",
        REPO_ID,
        cwd=tmp_path,
        env=script_env(OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"staged the model from {gpt2} into" in result.stdout
    carried = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    assert set(snapshot(target)) == {
        *carried,
        "model.safetensors",
        "model.safetensors.index.json",
        "meta.json",
        "README.md",
        "MANIFEST.sha256",
    }
    for name in {*carried, "model.safetensors"}:  # byte for byte
        assert (target / name).read_bytes() == (gpt2 / name).read_bytes(), name
    meta = json.loads((target / "meta.json").read_text())
    assert meta["step"] is None and meta["metrics"] is None
    assert meta["export"]["architecture"] == "GPT2LMHeadModel" and meta["export"]["transformers"]
    assert (
        meta["source_checkpoint"]["files"]["model.safetensors"]["size"]
        == (gpt2 / "model.safetensors").stat().st_size
    )
    card = ModelCard.load(target / "README.md")
    assert card.data.library_name == "transformers" and "model-index" not in card.content
    assert "None were supplied" in card.text and "No resume proof" in card.text
    with LocalHub(tmp_path / "hub", token=TOKEN) as hub:
        published = publish_stage(target, hub.url, REPO_ID, TOKEN)
        assert published.returncode == 0, published.stdout + published.stderr
        assert "published the model to" in published.stdout
        commits = HfApi(endpoint=hub.url, token=TOKEN).list_repo_commits(REPO_ID)
        assert len(commits) == 2 and commits[0].title.startswith(
            "Publish the model: model.safetensors sha256 "
        )
        use = f"""
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
source = load_file({str(gpt2 / "model.safetensors")!r})
assert type(model).__name__ == "GPT2LMHeadModel"
state = AutoModelForCausalLM.from_pretrained("{REPO_ID}").state_dict()
for name, tensor in source.items():
    assert torch.equal(tensor.view(torch.uint8), state[name].view(torch.uint8)), name
    assert torch.equal(tensor.view(torch.uint8), model.state_dict()[name].view(torch.uint8)), name
assert set(state) - set(source) == {{"lm_head.weight"}}
assert torch.equal(state["lm_head.weight"], source["transformer.wte.weight"]), "tied"
assert AutoTokenizer.from_pretrained("{REPO_ID}")("hello world").input_ids == [1, 2]
print("EQUAL", len(source))
"""
        card_code = first_python_block((target / "README.md").read_text(encoding="utf-8"))
        loaded = run_as_hub_user(card_code + "\n" + use, tmp_path / "user", hub.url, TOKEN)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert "EQUAL" in loaded.stdout


def test_the_same_folder_with_only_a_pickled_pytorch_model_bin_is_refused_with_how_to_convert(
    folder, tmp_path
):
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    result = run_script(
        "05_stage.py", "--from-folder", str(folder), "--stage", str(tmp_path / "stage"), cwd=tmp_path
    )
    assert result.returncode == 2
    line = one_line_error(result)
    assert f"{folder / 'pytorch_model.bin'} is a pickle" in line and "save_pretrained" in line
    assert not (tmp_path / "stage").exists()


# -- bad folders: one line, exit 2, nothing staged ------------------------------------------------


def empty(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.mkdir()


def pickle_named_safetensors(folder: Path) -> None:
    torch.save(load_file(folder / "model.safetensors"), folder / "model.safetensors")


def config_not_json(folder: Path) -> None:
    (folder / "config.json").write_text("{'n_layer': 1}")


def resave_sharded(folder: Path) -> list[str]:
    model = transformers.GPT2LMHeadModel.from_pretrained(folder)
    (folder / "model.safetensors").unlink()
    model.save_pretrained(folder, max_shard_size="2KB")
    shards = sorted(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(set(shards)) > 1
    return sorted(set(shards))


def index_names_a_missing_shard(folder: Path) -> None:
    (folder / resave_sharded(folder)[-1]).unlink()


def link_out_of_the_folder(folder: Path) -> None:
    outside = folder.parent / "elsewhere.json"
    outside.write_text("{}")
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").symlink_to(outside)


def tensor_in_two_shards(folder: Path) -> None:
    first, second = resave_sharded(folder)[:2]
    one, two = load_file(folder / first), load_file(folder / second)
    name = sorted(one)[0]
    save_file({**two, name: one[name]}, folder / second, metadata={"format": "pt"})


def index_lists_a_tensor_twice(folder: Path) -> None:
    resave_sharded(folder)
    path = folder / "model.safetensors.index.json"
    text = path.read_text()
    start = text.index('"transformer.wte.weight"')
    line = text[start : text.index("\n", start)].rstrip(",")
    path.write_text(text.replace(line, f"{line},\n    {line}", 1))


def seal_that_does_not_match(folder: Path) -> None:
    seal_checkpoint(folder, step=7)
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (folder / "model.safetensors").write_bytes(bytes(data))


def checkpoint_of_this_pipeline(folder: Path) -> None:
    (folder / "meta.json").write_text(json.dumps({"schema": "pipeline.checkpoint/2", "step": 3}))


def code_as_architecture(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel\nimport os; os.system('id')"]
    (folder / "config.json").write_text(json.dumps(config))


def several_safetensors_without_an_index(folder: Path) -> None:
    resave_sharded(folder)
    (folder / "model.safetensors.index.json").unlink()


def a_stray_shard_beside_the_weights(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    name = sorted(tensors)[0]
    save_file({name: tensors[name]}, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})


def weights_without_tensors(folder: Path) -> None:
    save_file({}, folder / "model.safetensors")


def a_stale_single_file_beside_shards(folder: Path) -> None:
    stale = (folder / "model.safetensors").read_bytes()
    resave_sharded(folder)
    (folder / "model.safetensors").write_bytes(stale)


def index_maps_a_tensor_to_a_shard_that_does_not_hold_it(folder: Path) -> None:
    first, second = resave_sharded(folder)[:2]
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    moved = sorted(load_file(folder / first))[0]
    index["weight_map"][moved] = second
    path.write_text(json.dumps(index))


BAD = {
    empty: "is empty",
    several_safetensors_without_an_index: ".safetensors files (model-00001-of-0000",
    a_stray_shard_beside_the_weights: "holds 2 .safetensors files (model-00002-of-00002.safetensors, model.safetensors)",
    weights_without_tensors: "model.safetensors holds no tensors",
    pickle_named_safetensors: "model.safetensors is not a valid safetensors file",
    config_not_json: "config.json is not valid JSON",
    index_names_a_missing_shard: "which is missing from",
    link_out_of_the_folder: "tokenizer_config.json is a link to",
    tensor_in_two_shards: "is listed twice",
    index_lists_a_tensor_twice: "appears twice",
    seal_that_does_not_match: "model.safetensors: SHA-256 differs from its seal",
    checkpoint_of_this_pipeline: "a checkpoint of this pipeline (the scripts read it with --checkpoint)",
    code_as_architecture: "architectures must be a list of Python class names",
    a_stale_single_file_beside_shards: "holds both model.safetensors and model.safetensors.index.json",
    index_maps_a_tensor_to_a_shard_that_does_not_hold_it: "model.safetensors.index.json does not map tensor",
}


@pytest.mark.parametrize("damage", list(BAD), ids=lambda f: f.__name__)
def test_a_bad_folder_is_refused_in_one_line_and_the_previous_stage_stays(
    gpt2, folder, tmp_path, damage: Callable
):
    """In process (the script's run_main prints a PipelineError as its one line, exit 2: the
    next test runs the script)."""
    target = tmp_path / "stage"
    stage(gpt2, target)
    before = snapshot(target)
    damage(folder)
    with pytest.raises(PipelineError) as refused:
        stage(folder, target)
    assert BAD[damage] in str(refused.value)
    assert "\n" not in str(refused.value) and refused.value.exit_code == 2
    assert ".tmp-" not in str(refused.value) and ".scratch-" not in str(
        refused.value
    )  # the user's files named
    assert snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".stage.lock"]


@pytest.mark.parametrize("damage", [empty, link_out_of_the_folder], ids=lambda f: f.__name__)
def test_05_prints_one_error_line_and_exits_2_on_a_bad_folder(folder, tmp_path, damage: Callable):
    damage(folder)
    result = run_script(
        "05_stage.py", "--from-folder", str(folder), "--stage", str(tmp_path / "stage"), cwd=tmp_path
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert BAD[damage] in one_line_error(result)
    assert not (tmp_path / "stage").exists()


def test_05_warns_of_an_unsealed_checkpoint_and_a_hard_linked_file_and_stages_them(folder, tmp_path):
    checkpoint = folder.rename(tmp_path / "checkpoint-500")
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
    outside = tmp_path / "elsewhere.json"
    os.link(checkpoint / "tokenizer_config.json", outside)  # the same bytes under a name outside
    result = run_script(
        "05_stage.py", "--from-folder", str(checkpoint), "--stage", str(tmp_path / "stage"), cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2, result.stderr
    assert warnings[0].startswith(
        f"warning: {checkpoint} looks like a trainer's checkpoint (its name, checkpoint-500)"
    )
    assert "carries no seal" in warnings[0] and "seal_checkpoint" in warnings[0]
    assert warnings[1].startswith(f"warning: {checkpoint / 'tokenizer_config.json'} has 2 hard links")
    seal_checkpoint(checkpoint, step=500)
    os.unlink(outside)
    again = run_script(
        "05_stage.py", "--from-folder", str(checkpoint), "--stage", str(tmp_path / "stage"), cwd=tmp_path
    )
    assert again.returncode == 0 and "warning:" not in again.stderr, again.stderr


@pytest.mark.parametrize("state", ["optimizer.pt", "scheduler.pt", "rng_state_1.pth", "trainer_state.json"])
def test_a_folder_holding_a_trainers_state_under_any_name_looks_like_a_checkpoint(gpt2, tmp_path, state):
    """The folder's name is one sign (checkpoint-500), the trainer's state beside the weights
    another: either makes an unsealed folder worth the warning that it may be half-written."""
    from pipeline.stage.folder_source import survey_folder

    folder = Path(shutil.copytree(gpt2, tmp_path / "my-model"))
    assert survey_folder(folder).checkpoint_like is None
    (folder / state).write_bytes(b"{}")
    inventory = survey_folder(folder)
    assert inventory.checkpoint_like == f"it holds {state}" and state in inventory.left_out


def test_an_unsealed_folder_named_checkpoint_0_is_warned_of_like_any_other_checkpoint(gpt2, tmp_path):
    """checkpoint-0 (saved before the first step) is a checkpoint's name as much as checkpoint-5:
    staged unsealed, either is warned of, the warning naming it."""
    warned = []
    for name in ("checkpoint-0", "checkpoint-5"):
        checkpoint = Path(shutil.copytree(gpt2, tmp_path / name))
        warned.append(stage(checkpoint, tmp_path / f"stage-{name}").warnings)
    assert warned == [
        [
            f"{tmp_path / name} looks like a trainer's checkpoint (its name, {name}) but carries no seal: nothing "
            "shows its save finished; staged as read. If you trust it, seal it first with "
            "pipeline.integrations.seal.seal_checkpoint (docs/other-trainers.md)"
        ]
        for name in ("checkpoint-0", "checkpoint-5")
    ]


def test_supplied_metrics_that_are_a_fifo_are_refused_without_waiting(gpt2, tmp_path):
    import threading

    fifo = tmp_path / "metrics.json"
    os.mkfifo(fifo)
    # Without O_NONBLOCK the open would wait for a writer forever: this one comes after 20 s.
    rescue = threading.Timer(20, lambda: os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)))
    rescue.start()
    try:
        with pytest.raises(StageError, match=r"--metrics .*metrics\.json is a FIFO, not a regular file"):
            stage(gpt2, tmp_path / "stage", metrics=fifo)
    finally:
        rescue.cancel()
    assert not (tmp_path / "stage").exists()


def test_a_stage_inside_the_folder_it_stages_is_refused(folder):
    with pytest.raises(StageError, match="overlap"):
        stage(folder, folder / "stage")
    assert not (folder / "stage").exists()


# -- what is staged ---------------------------------------------------------------------------------


def _evil_pickle(marker: Path) -> bytes:
    """A pickle that creates ``marker`` when loaded."""
    import pickle

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    return pickle.dumps(Evil())


def test_a_sealed_trainer_checkpoint_stages_its_weights_and_never_opens_its_training_state(folder, tmp_path):
    marker = tmp_path / "unpickled"
    state = {
        name: _evil_pickle(marker)
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "scaler.pt")
    }
    for name, data in state.items():
        (folder / name).write_bytes(data)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 7}))
    (folder / "global_step7").mkdir()  # DeepSpeed's shards live in a folder like this
    (folder / "global_step7" / "zero.pt").write_bytes(_evil_pickle(marker))
    seal_checkpoint(folder, step=7)
    target = tmp_path / "stage"
    stage(folder, target)
    assert not marker.exists()
    staged = set(snapshot(target))
    assert not staged & {*state, "trainer_state.json", "global_step7/zero.pt"}
    meta = json.loads((target / "meta.json").read_text())
    assert meta["step"] == 7 and meta["source_checkpoint"]["sealed"]
    assert set(meta["source_checkpoint"]["left_out"]) == {*state, "trainer_state.json", "global_step7/"}
    card = (target / "README.md").read_text()
    assert "It holds training step 7. Its seal" in card and "`optimizer.pt`" in card


def test_a_file_changed_after_its_seal_was_checked_is_refused(folder, tmp_path, monkeypatch):
    """Every byte staged is compared with the seal as it is read, not only when the seal is checked."""
    import pipeline.stage.folder_source as source

    seal_checkpoint(folder, step=3)
    real = source.check_seal_in

    def check_then_change(checked) -> dict:
        seal = real(checked)
        tokenizer = checked.path / "tokenizer.json"
        tokenizer.write_bytes(tokenizer.read_bytes().replace(b"hello", b"jello"))  # same file, same size
        return seal

    monkeypatch.setattr(source, "check_seal_in", check_then_change)
    with pytest.raises(StageError, match=r"tokenizer\.json changed after it was sealed"):
        stage(folder, tmp_path / "stage")
    assert not (tmp_path / "stage").exists()


def test_a_sharded_folder_leaves_out_exactly_what_its_index_does_not_name_sealed_or_not(folder, tmp_path):
    """The shards the index names are read; a stray .safetensors it does not name, a subfolder
    and notes are left out, in the record and on the card, before and after a seal."""
    shards = resave_sharded(folder)
    (folder / "old-model.safetensors").write_bytes((folder / shards[0]).read_bytes())
    (folder / "runs").mkdir()
    (folder / "runs" / "model-00001-of-00002.safetensors").write_bytes((folder / shards[0]).read_bytes())
    (folder / "notes.txt").write_text("notes\n")
    for target in (tmp_path / "plain", tmp_path / "sealed"):
        if target.name == "sealed":
            seal_checkpoint(folder, step=3)
        stage(folder, target)
        record = json.loads((target / "meta.json").read_text())["source_checkpoint"]
        assert record["sealed"] is (target.name == "sealed")
        assert record["left_out"] == ["notes.txt", "old-model.safetensors", "runs/"]
        assert set(shards) <= set(record["files"]) and "old-model.safetensors" not in record["files"]
        card = ModelCard.load(target / "README.md").text
        assert "Left out, never opened: `notes.txt`, `old-model.safetensors`, `runs/`." in card


def test_sharded_weights_are_read_through_their_index_and_resharded_as_asked(folder, tmp_path):
    shards = resave_sharded(folder)
    source = {name: tensor for shard in shards for name, tensor in load_file(folder / shard).items()}
    whole = tmp_path / "whole"
    stage(folder, whole)
    meta = json.loads((whole / "meta.json").read_text())
    assert meta["export"]["weights"] == ["model.safetensors"]
    # The shards were read through the index: neither the record nor the card calls them left out.
    assert meta["source_checkpoint"]["left_out"] == []
    assert set(shards) <= set(meta["source_checkpoint"]["files"])
    assert "Left out, never opened: nothing." in ModelCard.load(whole / "README.md").text
    staged = load_file(whole / "model.safetensors")
    assert staged.keys() == source.keys() and all(torch.equal(staged[k], source[k]) for k in source)
    split = tmp_path / "split"
    stage(folder, split, max_shard_size="3KB")
    weight_map = json.loads((split / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    card = ModelCard.load(split / "README.md").text
    assert (
        f"in {len(files)} shards (`{files[0]}` … `{files[-1]}`, listed in `model.safetensors.index.json`)."
        in card
    ), card
    assert "parameters in `model.safetensors`." in ModelCard.load(whole / "README.md").text
    model = transformers.GPT2LMHeadModel.from_pretrained(split)
    assert all(torch.equal(model.state_dict()[k], source[k]) for k in source)


class TinyNet(torch.nn.Module, PyTorchModelHubMixin):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, width)


def test_a_sentencepiece_tokenizer_model_is_staged_byte_for_byte(folder, tmp_path):
    """docs/other-trainers.md: tokenizer files, ``*.model`` among them, are staged byte for byte:
    a Llama or T5 folder's tokenizer does not load without its SentencePiece model."""
    # A SentencePiece model is a protobuf: pieces with their scores and types.
    pieces = b"".join(
        b"\n" + bytes([len(p) + 7, 10, len(p)]) + p + b"\x15\x00\x00\x80\xbf\x18\x01"
        for p in (b"<unk>", b"\xe2\x96\x81hello", b"world")
    )
    (folder / "tokenizer.model").write_bytes(pieces)
    (folder / "spiece.model").write_bytes(pieces[::-1])
    target = tmp_path / "stage"
    stage(folder, target)
    assert (target / "tokenizer.model").read_bytes() == pieces
    assert (target / "spiece.model").read_bytes() == pieces[::-1]
    meta = json.loads((target / "meta.json").read_text())
    assert {"tokenizer.model", "spiece.model"} <= set(meta["source_checkpoint"]["files"]), meta[
        "source_checkpoint"
    ]


def test_a_pytorch_model_hub_mixin_folder_keeps_the_name_its_from_pretrained_loads(tmp_path):
    torch.manual_seed(1)
    net = TinyNet(width=3)
    net.save_pretrained(tmp_path / "net")
    target = tmp_path / "stage"
    stage(tmp_path / "net", target, repo_id="you/tiny-net")
    meta = json.loads((target / "meta.json").read_text())
    assert not meta["export"]["transformers"] and meta["source_checkpoint"]["left_out"] == ["README.md"]
    loaded = TinyNet.from_pretrained(target)
    assert loaded.layer.weight.shape == (3, 3)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), net.state_dict().values()))
    card = ModelCard.load(target / "README.md")
    assert card.data.library_name == "pytorch" and "from safetensors.torch import load_file" in card.text
    # Named as the repository its snippets download from, not as its namespace.
    assert card.text.startswith("\n# tiny-net\n") and card.data.model_name == "tiny-net", card.text[:200]


def test_supplied_metrics_are_shown_as_supplied_and_bad_ones_refused(gpt2, tmp_path):
    metrics = tmp_path / "eval.json"
    metrics.write_text(json.dumps({"eval_loss": 2.5, "epoch": 1}))
    target = tmp_path / "stage"
    stage(gpt2, target, metrics=metrics)
    meta = json.loads((target / "meta.json").read_text())
    assert meta["metrics"]["values"] == {"epoch": 1, "eval_loss": 2.5}
    card = ModelCard.load(target / "README.md")
    assert "As supplied by the publisher in `eval.json`" in card.text and "| `eval_loss` | 2.5 |" in card.text
    assert card.data.eval_results[0].metric_value in (1, 2.5)
    # A flag is not a number the card may show as a score (JSON's true is Python's 1).
    for value in ("low", True, False, None, [2.5], {"value": 2.5}):
        metrics.write_text(json.dumps({"eval_loss": 2.5, "converged": value}))
        with pytest.raises(StageError, match="'converged' must be a short metric name with a number"):
            stage(gpt2, tmp_path / "other", metrics=metrics)
    assert not (tmp_path / "other").exists()


def test_the_configs_card_sections_are_on_the_card_of_a_staged_folder(gpt2, tmp_path, monkeypatch):
    """card.sections (a path relative to the folder 05 runs in) goes on the card of a folder
    staged with --from-folder as on a checkpoint's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "card.md").write_text("## Intended use\n\nTeaching tokenizers to a tiny GPT-2.\n")
    target = tmp_path / "stage"
    stage_folder(folder_config({"card.sections": "card.md"}), FolderStage(folder=gpt2, stage_dir=target))
    card = ModelCard.load(target / "README.md").text
    assert "## Intended use\n\nTeaching tokenizers to a tiny GPT-2." in card, card


def test_nan_weights_are_refused_unless_allowed_and_then_the_card_warns(folder, tmp_path):
    tensors = load_file(folder / "model.safetensors")
    tensors["transformer.ln_f.bias"][0] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        NonFiniteWeights, match=r"model\.safetensors: tensor transformer\.ln_f\.bias holds NaN"
    ):
        stage(folder, tmp_path / "stage")
    assert not (tmp_path / "stage").exists()
    assert stage(folder, tmp_path / "stage", allow_nonfinite=True).nonfinite == ["transformer.ln_f.bias"]
    assert "`transformer.ln_f.bias`" in (tmp_path / "stage" / "README.md").read_text()


def test_a_token_in_a_carried_tokenizer_file_is_refused_unless_the_configs_card_allows_it(folder, tmp_path):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["note"] = FAKE_TOKEN
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(SecretInStage) as refused:
        stage(folder, tmp_path / "stage")
    assert str(refused.value) == (
        "tokenizer_config.json holds an hf_ token; nothing was staged. Remove it from where it came from "
        "(config card section, data, task sample, code, edits to the stage) and stage again; if it is not "
        "a secret (a documented example), allow it per file in the config: card.allow_leaks: "
        "{tokenizer_config.json: [hf-token]} (docs/publishing.md)"
    )
    assert not (tmp_path / "stage").exists()
    # A documented example the config's card.allow_leaks allows is staged, as for a checkpoint.
    allowed = {"tokenizer_config.json": ["hf-token"]}
    target = tmp_path / "stage"
    stage_folder(folder_config({"card.allow_leaks": allowed}), FolderStage(folder=folder, stage_dir=target))
    assert json.loads((target / "tokenizer_config.json").read_text())["note"] == FAKE_TOKEN
    assert json.loads((target / "meta.json").read_text())["config"]["card"]["allow_leaks"] == allowed
    # ... and 06's audit (which reads the allowance from the staged meta.json) lets it go.
    assert audit_stage(target, leaks=leak_rules())["tokenizer_config.json"].allowed_leaks == ("an hf_ token",)


def test_a_false_positive_allowed_by_card_allow_leaks_is_staged_from_a_folder_and_only_in_its_file(
    folder, tmp_path
):
    """--set card.allow_leaks applies to a folder's stage as to a trainer's: the documented example
    it allows in one file is staged (and recorded for 06); the same value in another file is not."""
    what, text = SAMPLES["jwt"]
    example = text.split()[-1]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "note": example}))
    with pytest.raises(SecretInStage) as refused:
        stage(folder, tmp_path / "stage")
    assert str(refused.value).startswith(f"tokenizer_config.json holds {what};"), str(refused.value)
    assert not (tmp_path / "stage").exists()
    allow = {"card.allow_leaks": {"tokenizer_config.json": ["jwt"]}}
    stage_folder(folder_config(allow), FolderStage(folder=folder, stage_dir=tmp_path / "stage"))
    staged = json.loads((tmp_path / "stage" / "tokenizer_config.json").read_text())
    assert staged["note"] == example
    recorded = json.loads((tmp_path / "stage" / "meta.json").read_text())["config"]["card"]["allow_leaks"]
    assert recorded == {"tokenizer_config.json": ["jwt"]}
    (folder / "config.json").write_text(
        json.dumps({**json.loads((folder / "config.json").read_text()), "n": example})
    )
    with pytest.raises(SecretInStage) as refused:
        stage_folder(folder_config(allow), FolderStage(folder=folder, stage_dir=tmp_path / "other"))
    assert str(refused.value).startswith(f"config.json holds {what};"), str(refused.value)


def test_the_stage_passes_the_publish_side_audit_and_every_refusal_is_one_line(gpt2, tmp_path):
    target = tmp_path / "stage"
    stage(gpt2, target)
    assert "model.safetensors" in audit_stage(target)
    with pytest.raises(PipelineError) as refused:
        stage(tmp_path / "missing", target)
    assert "\n" not in str(refused.value) and refused.value.exit_code == 2
    assert os.path.isdir(target)
