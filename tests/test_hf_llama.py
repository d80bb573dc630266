"""examples/hf_llama through the real scripts 01, 02 (8 steps), 04, 05, 06, then used as the
Hub's own tools use it: AutoTokenizer, AutoModelForCausalLM and pipeline("text-generation")
in a process that cannot import this project, and the stage compared with what
transformers' own save_pretrained writes for the same weights."""

from __future__ import annotations

import json
import secrets

import pytest
from huggingface_hub import ModelCard
from safetensors import safe_open

from localhub import LocalHub

from support import REPO, first_python_block, publish_stage, run_as_hub_user, run_script, script_env

transformers = pytest.importorskip("transformers")
# Every test reads the one published repo: they go to one xdist worker, so it is built once.
pytestmark = pytest.mark.xdist_group("hf-llama")

CONFIG = REPO / "examples" / "hf_llama" / "config.yaml"
REPO_ID = "test/tiny-llama"
TOKEN = f"llama-{secrets.token_hex(8)}"
TINY = {
    "data.params.max_chars": "6000",
    "data.params.block_size": "32",
    "data.params.sample_chars": "20",
    "data.batch_size": "8",
    "model.params.hidden_size": "32",
    "model.params.intermediate_size": "64",
    "training.max_steps": "8",
    "scheduler.params.warmup_steps": "2",
}


def _ok(name: str, *args: str) -> None:
    result = run_script(name, "--config", str(CONFIG), *args, env=script_env(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, f"{name} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_llama")
    overrides = {**TINY, "data.dir": str(root / "data"), "checkpoint.dir": str(root / "checkpoints")}
    args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    _ok("01_prepare_data.py", *args)
    _ok("02_train.py", *args, "--quiet")
    _ok("04_evaluate.py", *args, "--output", str(root / "metrics.json"))
    _ok(
        "05_stage.py",
        *args,
        "--metrics",
        str(root / "metrics.json"),
        "--stage",
        str(root / "stage"),
        "--repo-id",
        REPO_ID,
    )
    with LocalHub(root / "hub", token=TOKEN) as hub:
        result = publish_stage(root / "stage", hub.url, REPO_ID, TOKEN)
        assert result.returncode == 0, result.stdout + result.stderr
        yield {"root": root, "stage": root / "stage", "hub": hub}


def test_hub_tools_load_tokenizer_model_and_pipeline_without_this_project(published, tmp_path):
    card = (published["stage"] / "README.md").read_text(encoding="utf-8")
    # The card's own three lines made `tokenizer`, `model` and `generator`; the repo name works too.
    use = f"""
import torch, transformers
from safetensors.torch import load_file
assert type(model).__name__ == "LlamaForCausalLM"
assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight), "tied"
assert tokenizer("HAMLET:").input_ids == list(b"HAMLET:"), "one token per byte, id = byte"
published = load_file(folder / "modelo.safetensors")
state = transformers.AutoModelForCausalLM.from_pretrained("{REPO_ID}").state_dict()
for name, tensor in published.items():
    assert torch.equal(tensor.view(torch.uint8), state[name].view(torch.uint8)), name
assert torch.equal(state["lm_head.weight"], published["model.embed_tokens.weight"]), "tied to the published embedding"
text = generator("HAMLET:", max_new_tokens=12, do_sample=False)[0]["generated_text"]
assert text.startswith("HAMLET:") and len(text) > len("HAMLET:"), text
print("GENERATED", repr(text))
"""
    result = run_as_hub_user(
        first_python_block(card) + "\n" + use, tmp_path / "empty", published["hub"].url, TOKEN
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "GENERATED" in result.stdout


def test_stage_holds_what_save_pretrained_writes_with_the_tied_weight_under_transformers_name(
    published, tmp_path
):
    stage = published["stage"]
    model = transformers.LlamaForCausalLM.from_pretrained(stage)
    model.save_pretrained(tmp_path / "reference")
    for name in ("config.json", "generation_config.json"):
        assert json.loads((stage / name).read_text()) == json.loads(
            (tmp_path / "reference" / name).read_text()
        ), name
    with (
        safe_open(str(stage / "modelo.safetensors"), "pt") as ours,
        safe_open(str(tmp_path / "reference" / "model.safetensors"), "pt") as theirs,
    ):
        assert set(ours.keys()) == set(theirs.keys())
        assert "model.embed_tokens.weight" in ours.keys() and "lm_head.weight" not in ours.keys()
        assert ours.metadata() == {"format": "pt"}
    index = json.loads((stage / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"modelo.safetensors"}
    stored = {name: tensor for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    meta = json.loads((stage / "meta.json").read_text())
    assert meta["export"]["renamed"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(meta["files"])
    # from_pretrained needs no code from the repository: none is published.
    assert not (stage / "code").exists() and not any(name.startswith("code/") for name in meta["files"])


def test_card_front_matter_names_transformers_and_the_configured_task(published):
    card = ModelCard.load(published["stage"] / "README.md")
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation" and card.data.language == ["en"]
    assert "AutoModelForCausalLM.from_pretrained(folder" in card.text
    assert "AutoTokenizer.from_pretrained(folder)" in card.text and 'pipeline("text-generation"' in card.text
    assert "step **8**, the last step of its run" in card.text


def test_no_staged_file_carries_a_machine_path_user_or_host_name(published):
    """The run's folders were absolute paths outside the working folder (the repository)."""
    import os
    import re
    import socket

    stage = published["stage"]
    needles = {str(published["root"]).encode(), str(REPO).encode(), os.path.expanduser("~").encode() + b"/"}
    host = socket.gethostname().encode()
    for path in sorted(p for p in stage.rglob("*") if p.is_file()):
        data = path.read_bytes()
        for needle in needles:
            assert needle not in data, f"{path.name} holds {needle!r}"
        # The records only: the host name may be an ordinary word that prose or code uses.
        if path.name in ("meta.json", "config.json"):
            assert not re.search(rb"(?<![\w.-])" + re.escape(host) + rb"(?![\w-])", data), (
                f"{path.name} names the host"
            )
    config = json.loads((stage / "meta.json").read_text())["config"]
    assert (config["data"]["dir"], config["checkpoint"]["dir"]) == ("<data.dir>", "<checkpoint.dir>")
