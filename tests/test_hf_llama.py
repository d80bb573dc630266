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
from pipeline.hashing import sha256_file
from pipeline.stage.card import build_model_card

from support import (
    REPO,
    first_python_block,
    one_line_error,
    publish_stage,
    run_as_hub_user,
    run_python,
    run_script,
    script_env,
)

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


def test_a_causal_lm_with_only_a_slow_tokenizers_files_still_gets_the_tokenizer_and_generation_snippet(
    published,
):
    """A slow tokenizer is tokenizer_config.json and its vocabulary files, no tokenizer.json:
    AutoTokenizer loads it all the same (docs/stage.md: a causal LM with a tokenizer)."""
    meta = json.loads((published["stage"] / "meta.json").read_text())
    files = {name: entry for name, entry in meta["files"].items() if name != "tokenizer.json"}
    assert "tokenizer_config.json" in files
    card = str(build_model_card(meta, files, repo_id=REPO_ID))
    assert "AutoTokenizer.from_pretrained(folder)" in card, card
    assert 'pipeline("text-generation", model=model, tokenizer=tokenizer)' in card, card


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


def test_a_changed_model_module_does_not_block_a_transformers_stage_but_weights_that_no_longer_fit_do(
    published, tmp_path
):
    """A transformers repo ships no code: a model module edited after training (a comment)
    is evaluated and staged with one warning naming it and both SHA-256s, recorded in
    metrics.json, meta.json and on the card; once the module is restored, those metrics were
    computed by other code than the stage ships, and 05 refuses them until 04 runs again; an
    edit that changes the model is still refused by the weights-fit check."""
    module = tmp_path / "tiny_llama.py"
    module.write_text(
        "from examples.hf_llama.model import build_model as built, hub_files  # noqa: F401\n"
        "def build_model(config):\n"
        "    return built(config)\n"
    )
    overrides = {**TINY, "data.dir": str(published["root"] / "data"), "training.max_steps": "2"}
    args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    args += ["--config", str(CONFIG), "--set", "model.factory=tiny_llama:build_model"]

    def script(name: str, *extra: str):
        return run_python([REPO / "scripts" / name, *args, *extra], cwd=tmp_path, env=script_env())

    assert script("02_train.py", "--quiet").returncode == 0
    trained = sha256_file(module)
    original = module.read_text()
    module.write_text(original + "# a comment\n")
    now = sha256_file(module)
    evaluated = script("04_evaluate.py")
    assert evaluated.returncode == 0, evaluated.stderr
    assert [line for line in evaluated.stderr.splitlines() if line.startswith("warning: ")] == [
        f"warning: tiny_llama.py (the model's code) changed since step 2 was trained (SHA-256 {trained} then, "
        f"{now} now); evaluated anyway, since this model ships no code and its weights must fit the model the "
        "code builds now (metrics.json records the files evaluated with)"
    ], evaluated.stderr
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["fingerprints"]["sources"]["tiny_llama.py"] == now
    staged = script("05_stage.py")
    assert staged.returncode == 0, staged.stderr
    warnings = [line for line in staged.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings == [
        f"warning: tiny_llama.py (the model's code) changed since step 2 was trained (SHA-256 {trained} then, "
        f"{now} now); staged anyway, since this stage ships no code and the weights fit the model the code "
        "builds now (recorded in meta.json provenance.code_changes and on the card)"
    ], staged.stderr
    meta = json.loads((tmp_path / "hub_stage" / "meta.json").read_text())
    assert meta["provenance"]["code_changes"] == [
        {
            "file": "tiny_llama.py",
            "role": "the model's code",
            "trained_sha256": trained,
            "current_sha256": now,
        }
    ]
    card = (tmp_path / "hub_stage" / "README.md").read_text()
    assert f"| code changed since training | `tiny_llama.py` (the model's code): SHA-256 `{trained}`" in card
    module.write_text(original)  # restored: now the code of training, not the code of the metrics
    line = one_line_error(script("05_stage.py"))
    assert (
        line.startswith(
            "error: metrics.json was computed under other code than this stage ships: tiny_llama.py (the model's "
            f"code) differs from the file 04 evaluated with (SHA-256 {now} then, {trained} now): rerun "
        )
        and "04_evaluate.py" in line
    ), line
    assert script("04_evaluate.py").returncode == 0
    restaged = script("05_stage.py")
    assert restaged.returncode == 0 and "warning" not in restaged.stderr, restaged.stderr
    module.write_text(
        "import dataclasses\n"
        "from examples.hf_llama.model import build_model as built, hub_files  # noqa: F401\n"
        "def build_model(config):\n"
        "    params = {**config.model.params, 'intermediate_size': 16}\n"
        "    return built(dataclasses.replace(config, model=dataclasses.replace(config.model, params=params)))\n"
    )
    line = one_line_error(script("05_stage.py", "--no-metrics"))
    assert "gate_proj.weight is torch.float32 (64, 32), the model expects torch.float32 (16, 32)" in line, (
        line
    )
