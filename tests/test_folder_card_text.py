"""The card of a folder another tool wrote (05 --from-folder), whole: what is known of the
folder (its seal, its files as read and as staged, what was left out, the publisher's own
metrics) and nothing more, compared sentence by sentence with a record it was rendered from."""

from __future__ import annotations

import json

import pytest
import torch
from test_card_text import A, B, C, digests
from test_hostile_folders import stage, tiny_folder

from pipeline.errors import StageError
from pipeline.stage.folder_card import build_folder_card


def _staged_folder(tmp_path) -> dict:
    target = tmp_path / "stage"
    stage(tiny_folder(tmp_path / "model"), target)
    return json.loads((target / "meta.json").read_text())


EVERY_PART_FOLDER_CARD = digests(
    "---\n"
    "library_name: pytorch\n"
    "license: apache-2.0\n"
    "metrics:\n"
    "- accuracy\n"
    "- eval_loss\n"
    "- f1\n"
    "- perplexity\n"
    "tags:\n"
    "- pytorch\n"
    "- safetensors\n"
    "model-index:\n"
    "- name: my model\n"
    "  results:\n"
    "  - task:\n"
    "      type: other\n"
    "      name: held-out evaluation\n"
    "    dataset:\n"
    "      name: my model held-out data\n"
    "      type: custom\n"
    "    metrics:\n"
    "    - type: eval_loss\n"
    "      value: 2.5\n"
    "      name: eval_loss\n"
    "    - type: accuracy\n"
    "      value: 0.75\n"
    "      name: accuracy\n"
    "    - type: f1\n"
    "      value: 0.30000000000000004\n"
    "      name: f1\n"
    "    - type: perplexity\n"
    "      value: 12.345678901234\n"
    "      name: perplexity\n"
    "---\n"
    "\n"
    "# `my model`\n"
    "\n"
    "`my model` is a PyTorch model with 20,480 parameters in 3 shards "
    "(`model-00001-of-00003.safetensors` … `model-00003-of-00003.safetensors`, listed in "
    "`model.safetensors.index.json`). It was trained with another tool; its files were checked and "
    "staged by `scripts/05_stage.py --from-folder`, which knows what they hold, not how they were "
    "made.\n"
    "\n"
    "## Intended use\n"
    "\n"
    "Teaching.\n"
    "\n"
    "## How to load it\n"
    "\n"
    "The weights and `config.json` of a PyTorch model; this repository holds no code, so the model "
    "is built with its own class. The snippet first checks every file against this card.\n"
    "\n"
    "```python\n"
    "import hashlib\n"
    "import json\n"
    "from pathlib import Path\n"
    "\n"
    "from huggingface_hub import snapshot_download\n"
    "from safetensors.torch import load_file\n"
    "\n"
    'repo_id = "you/net"\n'
    'revision = "main"  # pin a commit id or tag, e.g. revision="<commit sha>", for a reproducible '
    "download\n"
    "folder = Path(snapshot_download(repo_id, revision=revision))\n"
    "expected = {  # SHA-256 of every file, as listed on this card\n"
    '    "config.json": "<A>",\n'
    '    "model-00001-of-00002.safetensors": "<C>",\n'
    "}\n"
    "for name, sha256 in expected.items():\n"
    '    assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == sha256, f"{name} differs '
    'from the card"\n'
    "\n"
    'config = json.loads((folder / "config.json").read_text())\n'
    "state_dict = {}\n"
    "for name in sorted(set(json.loads((folder / "
    '"model.safetensors.index.json").read_text())["weight_map"].values())):\n'
    "    state_dict.update(load_file(folder / name))\n"
    "# With your model's class: a PyTorchModelHubMixin one loads with "
    "YourModel.from_pretrained(repo_id);\n"
    "# otherwise model = YourModel(**config); model.load_state_dict(state_dict)\n"
    "```\n"
    "\n"
    "## Metrics\n"
    "\n"
    "As supplied by the publisher in `eval.json`, for these weights; this pipeline did not compute "
    "them.\n"
    "\n"
    "| metric | value |\n"
    "| --- | --- |\n"
    "| `eval_loss` | 2.5 |\n"
    "| `accuracy` | 0.75 |\n"
    "| `f1` | 0.3 |\n"
    "| `perplexity` | 12.3457 |\n"
    "\n"
    "## Warning\n"
    "\n"
    "These tensors hold NaN or infinite values: `layer.weight`.\n"
    "\n"
    "## Signature\n"
    "\n"
    "Signed.\n"
    "\n"
    "## Source\n"
    "\n"
    "Staged from the folder `checkpoint-1200`. It holds training step 1,200. Its seal (`meta.json`, "
    "written by `SealedCheckpoints` or `seal_checkpoint`) verified: every file the trainer wrote was "
    "there, byte for byte. The weights were parsed strictly as safetensors and scanned for NaN and "
    "infinite values. Files read from it:\n"
    "\n"
    "| file | bytes | SHA-256 |\n"
    "| --- | ---: | --- |\n"
    "| `model-00002-of-00002.safetensors` | 4,096 | `<B>` |\n"
    "| `config.json` | 12 | `<A>` |\n"
    "\n"
    "Left out, never opened: `optimizer.pt`, `a\\x7cb\\x60c`. No resume proof goes with these weights: "
    "how they were trained was not checked.\n"
    "\n"
    "## Files and SHA-256\n"
    "\n"
    "| file | bytes | SHA-256 |\n"
    "| --- | ---: | --- |\n"
    "| `config.json` | 12 | `<A>` |\n"
    "| `model-00001-of-00002.safetensors` | 40,960 | `<C>` |\n"
    "\n"
    "`MANIFEST.sha256` lists every file of this repository except itself (this card included).\n"
    "\n"
    "## Verify\n"
    "\n"
    "```sh\n"
    "sha256sum -c MANIFEST.sha256\n"
    "```\n"
    "\n"
    "A matching hash shows the files were not modified after staging. It does not show who published "
    "them: compare the hashes with ones you obtained through a channel you trust, and pin a "
    "revision.\n"
)


THREE_SHARDS = (
    "in 3 shards (`model-00001-of-00003.safetensors` … `model-00003-of-00003.safetensors`, listed in "
)
TWO_SHARDS = (
    "in 2 shards (`model-00001-of-00002.safetensors` … `model-00002-of-00002.safetensors`, listed in "
)


@pytest.mark.parametrize("shards", [3, 2])
def test_a_folder_card_with_every_part_states_each_fact_of_its_record_in_order(tmp_path, shards):
    """A sealed checkpoint's folder: its step, its seal, its weights in three (or two) shards (the
    first and the last named), its files as read (in their order) and as staged (sorted), what was left out
    (inert), the publisher's metrics marked as theirs."""
    meta = _staged_folder(tmp_path)
    meta["config"]["model"]["name"] = "my model"
    meta.update(
        step=1200,
        metrics={
            "split": None,
            "supplied": "eval.json",
            # Shown to 6 significant digits: a float sum's noise and a long value's tail do not reach the table.
            "values": {"eval_loss": 2.5, "accuracy": 0.75, "f1": 0.1 + 0.2, "perplexity": 12.345678901234},
        },
    )
    meta["model"]["num_parameters"] = 20480
    meta["export"]["weights"] = [f"model-0000{i}-of-0000{shards}.safetensors" for i in range(1, shards + 1)]
    meta["checks"]["nonfinite_tensors"] = ["layer.weight"]
    meta["source_checkpoint"].update(
        folder="checkpoint-1200",
        sealed=True,
        left_out=["optimizer.pt", "a|b`c"],
        files={
            "model-00002-of-00002.safetensors": {"sha256": B, "size": 4096},
            "config.json": {"sha256": A, "size": 12},
        },
    )
    files = {
        "model-00001-of-00002.safetensors": {"sha256": C, "size": 40960},
        "config.json": {"sha256": A, "size": 12},
    }
    card = build_folder_card(
        meta,
        files,
        repo_id="you/net",
        signature_section="## Signature\n\nSigned.",
        user_sections="## Intended use\n\nTeaching.\n",
    )
    expected = (
        EVERY_PART_FOLDER_CARD if shards == 3 else EVERY_PART_FOLDER_CARD.replace(THREE_SHARDS, TWO_SHARDS)
    )
    assert expected != EVERY_PART_FOLDER_CARD or shards == 3
    assert str(card) == expected


def test_an_unsealed_folder_without_metrics_is_carded_as_what_is_known_and_no_more(tmp_path):
    """The publisher's own text (card.description, card.sections' file) is written as it is but
    for its control characters, spelled out: the Hub refuses a README holding a NUL byte, and an
    ESC or a bell garbles it."""
    meta = _staged_folder(tmp_path)
    meta["config"]["card"]["description"] = "\n A tiny\0 net, \x1b[1mbold\x1b[0m.  "
    sections = "## Intended use\n\nRing the bell\x07 twice.\n"
    card = str(build_folder_card(meta, meta["files"], user_sections=sections))
    paragraphs = card.split("\n\n")
    assert paragraphs[1:5] == [
        "# model",
        "A tiny\\x00 net, \\x1b[1mbold\\x1b[0m.",
        "## Intended use",
        "Ring the bell\\x07 twice.",
    ], paragraphs
    for paragraph in (
        "## Metrics\n\nNone were supplied with these weights, and none were computed when they were staged.",
        "## Source\n\nStaged from the folder `model`. It carried no seal, so nothing shows the folder was "
        "complete beyond what was checked here. The weights were parsed strictly as safetensors and scanned "
        "for NaN and infinite values. Files read from it:",
        "Left out, never opened: nothing. No resume proof goes with these weights: how they were trained was "
        "not checked.",
    ):
        assert paragraph in card, paragraph
    assert "## Warning" not in card and "## Signature" not in card and "training step" not in card
    # Blank (only spaces and line breaks): the default description, and no section of the user's.
    meta["config"]["card"]["description"] = " \n\t "
    described = str(build_folder_card(meta, meta["files"], user_sections=" \n\n ")).split("\n\n")[2:4]
    assert described == [
        "`model` is a PyTorch model with 20 parameters in `model.safetensors`. It was trained with another tool; "
        "its files were checked and staged by `scripts/05_stage.py --from-folder`, which knows what they hold, "
        "not how they were made.",
        "## How to load it",
    ]
    meta["export"].update(transformers=True, architecture="GPT2LMHeadModel")
    described = str(build_folder_card(meta, meta["files"])).split("\n\n")[2]
    assert described.startswith("`model` is a transformers `GPT2LMHeadModel` model with 20 parameters"), (
        described
    )


def test_a_sealed_folder_of_step_0_says_it_holds_step_0(tmp_path):
    """Step 0 (weights saved before the first optimizer step) is a step: only an unknown step is not said."""
    meta = _staged_folder(tmp_path)
    meta["step"] = 0
    meta["source_checkpoint"].update(folder="checkpoint-0", sealed=True)
    card = str(build_folder_card(meta, meta["files"])).split("\n\n")
    source = card.index("## Source")
    assert card[source + 1] == (
        "Staged from the folder `checkpoint-0`. It holds training step 0. Its seal (`meta.json`, written by "
        "`SealedCheckpoints` or `seal_checkpoint`) verified: every file the trainer wrote was there, byte for "
        "byte. The weights were parsed strictly as safetensors and scanned for NaN and infinite values. Files "
        "read from it:"
    )


def test_a_folder_in_three_shards_under_a_repo_page_with_metrics_at_their_edges_is_carded_whole(tmp_path):
    """Staged in three shards (first, middle and last named as save_pretrained names them), under
    --repo-id given as its page's address (the card is titled by the name after the namespace),
    with a publisher's metrics of exactly 0, negative, huge and integer values under names of up
    to 100 characters: each a number on the card, sorted by name; a name one longer is refused."""
    torch.manual_seed(0)
    folder = tiny_folder(tmp_path / "model", tensors={name: torch.randn(4) for name in "abc"})
    long = "m" * 100
    supplied = tmp_path / "eval.json"
    supplied.write_text(json.dumps({"zero": 0.0, "loss": -1.5, "perplexity": 1e300, long: 7}))
    target = tmp_path / "stage"
    stage(folder, target, metrics=supplied, repo_id="https://huggingface.co/you/tiny-net", max_shard_size=16)
    meta = json.loads((target / "meta.json").read_text())
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert meta["export"]["weights"] == shards and meta["repo_id"] == "you/tiny-net"
    assert meta["config"]["model"] == {"name": "tiny-net"}
    assert list(meta["metrics"]["values"].items()) == [
        ("loss", -1.5),
        (long, 7),
        ("perplexity", 1e300),
        ("zero", 0),
    ]
    card = (target / "README.md").read_text()
    paragraphs = card.split("\n\n")
    assert paragraphs[1:3] == [
        "# tiny-net",
        "`tiny-net` is a PyTorch model with 12 parameters in 3 shards (`model-00001-of-00003.safetensors` … "
        "`model-00003-of-00003.safetensors`, listed in `model.safetensors.index.json`). It was trained with "
        "another tool; its files were checked and staged by `scripts/05_stage.py --from-folder`, which knows "
        "what they hold, not how they were made.",
    ]
    metrics = paragraphs.index("## Metrics")
    assert paragraphs[metrics + 1 : metrics + 3] == [
        "As supplied by the publisher in `eval.json`, for these weights; this pipeline did not compute them.",
        f"| metric | value |\n| --- | --- |\n| `loss` | -1.5 |\n| `{long}` | 7 |\n| `perplexity` | 1e+300 |\n"
        "| `zero` | 0 |",
    ]
    supplied.write_text(json.dumps({long + "m": 1}))
    with pytest.raises(StageError) as refused:
        stage(folder, tmp_path / "other", metrics=supplied)
    assert str(refused.value) == (
        f"--metrics {supplied}: '{long}m' must be a short metric name with a number, as Trainer.evaluate() "
        "returns them"
    )
