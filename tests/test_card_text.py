"""The model cards' text, whole: a card is read by people on the Hub, so each one rendered from a
known record is compared with every sentence and row it must hold (a slip in any fact, order,
branch or escape shows as a difference), not searched for fragments."""

from __future__ import annotations

import json

from pipeline.stage.card import build_model_card
from pipeline.stage.recipe import recipe_rows

A, B, C, D = "a" * 64, "b" * 64, "c" * 64, "d" * 64
ONE = {"parallel": "none", "world_size": 1, "ddp_find_unused_parameters": None}
DDP = {"parallel": "ddp", "world_size": 2, "ddp_find_unused_parameters": True}


def digests(text: str) -> str:
    return text.replace("<A>", A).replace("<B>", B).replace("<C>", C).replace("<D>", D)


def _every_part(meta: dict) -> dict:
    """The staged record of a run with every optional part of the card: sharded weights, an
    accumulated, clipped fp16 DDP run moved from one process, extended, early-stopped, with a
    proof, metrics, two tensors holding NaN, and code changed since training."""
    config, training, provenance = meta["config"], meta["training"], meta["provenance"]
    meta["step"] = 7
    meta["model"]["num_parameters"] = 1234567
    meta["export"]["weights"] = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    config["data"]["batch_size"] = 5
    config["training"].update(max_steps=10, grad_accum_steps=2, grad_clip=1.0, amp="fp16", eval_every=2,
                              early_stopping_patience=2, early_stopping_threshold=0.001, seed=3)  # fmt: skip
    config["checkpoint"].update(best_metric="mse", best_mode="min")
    config["optimizer"].update(factory="pipeline.factories:sgd", lr=0.1, weight_decay=0.01, params={})
    config["scheduler"].update(factory="pipeline.factories:constant", params={})
    training.update(
        launch=DDP,
        final_loss=None,
        traces=None,
        stopped={"step": 7, "by": "pipeline.callbacks:EarlyStopping", "reason": "mse did not improve"},
        changes=[
            {"item": "intra_op_threads", "recorded": 1, "now": 2, "step": 5},
            {"item": "launch", "recorded": ONE, "now": DDP, "step": 3},
        ],
        lineage=[{"from_max_steps": 6, "at_step": 6, "to_max_steps": 10}],
    )
    meta["metrics"] = {
        "split": "heldout",
        "data_fingerprint": C,
        "device": "cpu",
        "values": {"rmse": 0.5, "mse": 0.25},
    }
    meta["checks"]["nonfinite_tensors"] = ["net.0.weight", "net.2.bias"]
    meta["proof"] = {
        "file": "resume_proof.json",
        "all_checks_passed": True,
        "positive": True,
        "negative_divergence_detected": True,
        "checks": 5,
        "checks_passed": 5,
        "tolerance": {"atol": 0, "rtol": 0},
        "steps": 8,
        "cut": 4,
        "controls": {"rng": "detected", "optimizer": "detected"},
    }
    provenance["environment"] = {
        "cudnn_benchmark": False,
        "cudnn_deterministic": True,
        "deterministic_algorithms": True,
        "device_type": "cpu",
        "inter_op_threads": 4,
        "intra_op_threads": 2,
        "numpy": "2.0.0",
        "torch": "2.5.0",
    }
    provenance["versions"] = {"torch": "2.5.0", "cuda": None, "python": "3.11.0", "numpy": "2.0.0"}
    provenance["fingerprints"].update(code=A, data=B)
    provenance["device"] = "cpu"
    provenance["code_changes"] = [
        {"file": "my_mlp.py", "role": "the model's code", "trained_sha256": A, "current_sha256": None},
        {"file": None, "role": "the data factory", "trained_sha256": None, "current_sha256": None},
    ]
    meta["source_checkpoint"].update(
        folder="step-00000007", files={"modelo.safetensors": D, "estado_treino.safetensors": C}
    )
    return meta


EVERY_PART_CARD = digests(
    "---\n"
    "library_name: pytorch\n"
    "license: apache-2.0\n"
    "metrics:\n"
    "- mse\n"
    "- rmse\n"
    "tags:\n"
    "- pytorch\n"
    "- safetensors\n"
    "- regression\n"
    "model-index:\n"
    "- name: regression-mlp\n"
    "  results:\n"
    "  - task:\n"
    "      type: other\n"
    "      name: held-out evaluation\n"
    "    dataset:\n"
    "      name: regression-mlp held-out data\n"
    "      type: custom\n"
    "      split: heldout\n"
    "    metrics:\n"
    "    - type: rmse\n"
    "      value: 0.5\n"
    "      name: rmse\n"
    "    - type: mse\n"
    "      value: 0.25\n"
    "      name: mse\n"
    "---\n"
    "\n"
    "# regression-mlp\n"
    "\n"
    "`regression-mlp` is a PyTorch model with 1,234,567 parameters built by "
    "`pipeline.tasks.regression:build_model` and trained for 7 steps on data prepared by "
    "`pipeline.tasks.regression:prepare_data`. The weights are stored in 2 shards "
    "(`model-00001-of-00002.safetensors` … `model-00002-of-00002.safetensors`, listed in "
    "`model.safetensors.index.json`) (float64); `meta.json` records the config, metrics and "
    "provenance.\n"
    "\n"
    "This is step **7**, the last step of its run; 1,234,567 parameters in 2 shards "
    "(`model-00001-of-00002.safetensors` … `model-00002-of-00002.safetensors`, listed in "
    "`model.safetensors.index.json`). The run, planned for 6 steps, was extended at step 6 to 10 "
    "(optimizer, data order and random states continued; the learning-rate schedule kept its first "
    "length). It stopped early at step 7: mse did not improve (pipeline.callbacks:EarlyStopping).\n"
    "\n"
    "## Intended use\n"
    "\n"
    "Teaching.\n"
    "\n"
    "## How to load it\n"
    "\n"
    "This needs only `torch`, `safetensors` and `huggingface_hub`. **Loading runs this repository's "
    "Python code**: the model's own modules are under `code/` (listed with their SHA-256 below) with "
    "`code/hub_loader.py`, which rebuilds the model with the factory and config that `config.json` "
    "names and loads the weights strictly. The snippet checks every file against this card before "
    "importing anything. Pin `revision=` to a commit id (or a tag) so that what you load cannot "
    "change under you.\n"
    "\n"
    "```python\n"
    "import hashlib\n"
    "import sys\n"
    "from pathlib import Path\n"
    "\n"
    "from huggingface_hub import snapshot_download\n"
    "\n"
    'repo_id = "you/mlp"\n'
    'revision = "main"  # pin a commit id or tag, e.g. revision="<commit sha>", for a reproducible '
    "download\n"
    "folder = Path(snapshot_download(repo_id, revision=revision))\n"
    "expected = {  # SHA-256 of every file, as listed on this card\n"
    '    "model-00001-of-00002.safetensors": "<A>",\n'
    '    "model-00002-of-00002.safetensors": "<B>",\n'
    "}\n"
    "for name, sha256 in expected.items():\n"
    '    assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == sha256, f"{name} differs '
    'from the card"\n'
    "\n"
    "# This imports and runs the Python files under code/ of this repository: read them first.\n"
    'sys.path.insert(0, str(folder / "code"))\n'
    "from hub_loader import load_model  # code/hub_loader.py: factory, config, strict load\n"
    "model = load_model(folder)\n"
    "```\n"
    "\n"
    "## Training\n"
    "\n"
    "| | |\n"
    "| --- | --- |\n"
    "| steps | 7 |\n"
    "| final training loss | n/a |\n"
    "| effective batch | 10 rows per optimizer step (2 micro-batches of 5, their gradients "
    "accumulated); each micro-batch split over 2 processes, 2 or 3 rows each |\n"
    "| gradient clipping | total L2 norm clipped to 1.0 |\n"
    "| precision | float64 parameters, autocast to float16, losses scaled by a GradScaler |\n"
    "| optimizer | `pipeline.factories:sgd`, lr 0.1, weight decay 0.01 |\n"
    "| schedule | `pipeline.factories:constant`, stepped once per optimizer step |\n"
    "| evaluation | every 2 optimizer steps and at step 10; the best by `mse` (min) kept as "
    "`--checkpoint best` |\n"
    "| early stopping | after 2 evaluations without an improvement of `mse` (min) by more than 0.001 "
    "|\n"
    "| seed | 3 |\n"
    "| launch | 2 processes (DDP, find_unused_parameters) on cpu |\n"
    "| history | trained in one process; moved to 2 processes (DDP, find_unused_parameters) after "
    "step 3; intra_op_threads changed from 1 to 2 after step 5; extended from 6 to 10 steps after "
    "step 6 |\n"
    "| parameters | 1,234,567 |\n"
    "\n"
    "No training curve: matplotlib was not installed where this model was staged.\n"
    "\n"
    "No TensorBoard traces: tensorboard was not installed where this model was staged (pip install "
    "'exact-resume-pipeline[traces]').\n"
    "\n"
    "## Metrics\n"
    "\n"
    "On the held-out split (`heldout`) of the prepared data (fingerprint `cccccccccccc`), evaluated "
    "with exactly the weights below (step 7):\n"
    "\n"
    "| metric | value |\n"
    "| --- | --- |\n"
    "| mse | 0.25 |\n"
    "| rmse | 0.5 |\n"
    "\n"
    "Full-precision values are in `meta.json` under `metrics`.\n"
    "\n"
    "## Sample\n"
    "\n"
    "Output of the task's `sample()` with these weights (control characters written as `\\xNN`):\n"
    "\n"
    "```text\n"
    "hi\\x00there\n"
    "```\n"
    "\n"
    "## Warning\n"
    "\n"
    "These tensors hold NaN or infinite values: `net.0.weight`, `net.2.bias`.\n"
    "\n"
    "## Signature\n"
    "\n"
    "Signed.\n"
    "\n"
    "## Resume proof\n"
    "\n"
    "Resuming this training run is **proven**: a run cut at step 4 and resumed in a new process "
    "matched the uninterrupted run over 8 steps in 5 of 5 checks, bitwise (tolerance 0). Negative "
    "controls (resumes that leave one saved component out, which must diverge): optimizer: detected, "
    "rng: detected. The proof was made with this checkpoint's config, code and data fingerprints; "
    "the full report is [`resume_proof.json`](resume_proof.json).\n"
    "\n"
    "## Files and SHA-256\n"
    "\n"
    "| file | bytes | SHA-256 |\n"
    "| --- | ---: | --- |\n"
    "| `model-00001-of-00002.safetensors` | 1,234,567 | `<A>` |\n"
    "| `model-00002-of-00002.safetensors` | 2,048 | `<B>` |\n"
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
    "\n"
    "## Reproduce\n"
    "\n"
    "The weights are the deterministic result of the recorded config, code and data: with this "
    "pipeline's scripts, in an empty folder holding this repository's `meta.json`, run\n"
    "\n"
    "```sh\n"
    "python -c \"import json, yaml; yaml.safe_dump(json.load(open('meta.json'))['config'], "
    "open('config.yaml', 'w'))\"\n"
    "python scripts/01_prepare_data.py --config config.yaml\n"
    "python scripts/02_train.py --config config.yaml --set training.max_steps=6\n"
    "```\n"
    "\n"
    "on a platform with the same\n"
    "\n"
    "- torch 2.5.0, NumPy 2.0.0\n"
    "- device type `cpu`\n"
    "- dtype `float64`, AMP `fp16`\n"
    "- deterministic algorithms True, cuDNN deterministic True, cuDNN benchmark False\n"
    "- 2 intra-op and 4 inter-op threads (`training.threads` pins the first)\n"
    "- the pipeline's code fingerprint `<A>` and the data fingerprint `<B>` (script 01 prepares the "
    "data from `data.seed`)\n"
    "\n"
    "(the libraries recorded: numpy 2.0.0, python 3.11.0, torch 2.5.0). This run was extended "
    "(`training.lineage` in `meta.json`): after the first command, continue it with `--resume latest "
    "--extend-to N` at each step the lineage lists, stopping at step 7. The checkpoint's weights "
    "then have the SHA-256 listed above, and staging it as this one was (`scripts/04_evaluate.py`, "
    "then `scripts/05_stage.py` with the same flags) gives the same bytes for every file of "
    "`MANIFEST.sha256`: nothing staged holds a wall-clock time, a host name or a machine path. "
    "Another thread count, device or library version computes other sums: the weights then differ in "
    "their last bits, and so do the digests.\n"
    "\n"
    "## Provenance\n"
    "\n"
    "| | |\n"
    "| --- | --- |\n"
    "| source checkpoint | `step-00000007` |\n"
    "| its `modelo.safetensors` | SHA-256 `<D>` |\n"
    "| its `estado_treino.safetensors` | SHA-256 `<C>` |\n"
    "| code fingerprint | `<A>` |\n"
    "| data fingerprint | `<B>` |\n"
    "| libraries | numpy 2.0.0, python 3.11.0, torch 2.5.0 |\n"
    "| code changed since training | `my_mlp.py` (the model's code): SHA-256 `<A>` when trained, "
    "none when staged |\n"
    "| code changed since training | a file of the data factory (which one the checkpoint cannot "
    "tell) |\n"
    "\n"
    "Fingerprints are SHA-256 over the package's Python sources and over the prepared data files. "
    "The code that built the model changed after these weights were trained (the rows above): this "
    "repository ships no code, and the weights were checked to fit the model the changed code "
    "builds.\n"
)


def test_a_card_with_every_part_states_each_fact_of_its_record_in_order(staged_run):
    """Every section, row and sentence of a card from a record that sets every optional part:
    the rows of the recipe and the launch history, the sorted metrics and proof controls, the
    files sorted by name, escapes in the sample, the front matter the Hub indexes."""
    meta = _every_part(json.loads((staged_run.stage / "meta.json").read_text()))
    files = {
        "model-00002-of-00002.safetensors": {"sha256": B, "size": 2048},
        "model-00001-of-00002.safetensors": {"sha256": A, "size": 1234567},
    }
    card = build_model_card(
        meta,
        files,
        repo_id="you/mlp",
        sample="hi\x00there",
        curve_file=None,
        signature_section="## Signature\n\nSigned.",
        user_sections="\n## Intended use\n\nTeaching.\n\n",
    )
    assert str(card) == EVERY_PART_CARD


def _paragraphs(card) -> list[str]:
    return str(card).split("\n\n")


def test_an_unevaluated_intermediate_checkpoint_is_carded_and_reproduced_as_one(staged_run):
    """The other side of each branch the card above took: a description of the config's own,
    a step short of the run's length (and --stop-at there), no metrics and no proof, a curve
    and traces staged, no --repo-id (the snippet reads a downloaded folder), no code change."""
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    meta.update(step=4, metrics=None)
    meta["config"]["card"]["description"] = "  A tiny regression model.\n"
    card = build_model_card(meta, {"modelo.safetensors": {"sha256": A, "size": 3296}})
    assert card.data.eval_results is None and card.data.metrics is None
    paragraphs = _paragraphs(card)
    assert paragraphs[1:4] == [
        "# regression-mlp",
        "A tiny regression model.",
        "This is step **4**, an intermediate checkpoint of a run configured for 10 steps; 353 parameters in "
        "`modelo.safetensors`.",
    ]
    for paragraph in (
        "This needs only `torch`, `safetensors` and `huggingface_hub`. **Loading runs this repository's Python "
        "code**: the model's own modules are under `code/` (listed with their SHA-256 below) with "
        "`code/hub_loader.py`, which rebuilds the model with the factory and config that `config.json` names "
        "and loads the weights strictly. The snippet checks every file against this card before importing "
        "anything. Download this repository first (`hf download <its id> --local-dir model`, its id shown at "
        "the top of its page), then run this beside the `model` folder.",
        "```python\nimport hashlib\nimport sys\nfrom pathlib import Path",
        'folder = Path("model")  # this repository, downloaded: hf download <its id> --local-dir model\n'
        f'expected = {{  # SHA-256 of every file, as listed on this card\n    "modelo.safetensors": "{A}",\n}}\n'
        "for name, sha256 in expected.items():\n"
        '    assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == sha256, f"{name} differs from '
        'the card"',
        "![Training loss and learning rate](training_curve.png)",
        "TensorBoard traces of the same history (`train/loss`, `train/lr`, `train/grad_norm`, `train/epoch` "
        "and each evaluation as `eval/<metric>`): [`runs/events.out.tfevents.pipeline`]"
        "(runs/events.out.tfevents.pipeline), shown on the Hub's *Training metrics* tab, or locally with "
        "`tensorboard --logdir runs`.",
        "## Metrics",
        "This checkpoint was staged without an evaluation (`scripts/05_stage.py --no-metrics`).",
        "No resume proof was staged with this checkpoint (`scripts/05_stage.py --proof DIR` stages the report "
        "of `scripts/03_verify_resume.py`).",
        "```sh\npython -c \"import json, yaml; yaml.safe_dump(json.load(open('meta.json'))['config'], "
        "open('config.yaml', 'w'))\"\npython scripts/01_prepare_data.py --config config.yaml\n"
        "python scripts/02_train.py --config config.yaml --stop-at 4\n```",
        "Fingerprints are SHA-256 over the package's Python sources and over the prepared data files.\n",
    ):
        assert paragraph in paragraphs, paragraph
    assert (
        "nothing staged holds a wall-clock time, a host name or a machine path, and the TensorBoard traces' "
        "events carry wall time 0. Another"
    ) in str(card)
    assert "code changed since training" not in str(card) and "## Sample" not in str(card)
    assert "## Warning" not in str(card) and "## Signature" not in str(card)
    table = str(card).split("## Training\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert table == [
        "| | |",
        "| --- | --- |",
        "| steps | 4 |",
        f"| final training loss | {meta['training']['final_loss']:.6g} |",
        "| effective batch | 4 rows per optimizer step |",
        "| gradient clipping | none |",
        "| precision | float64 parameters, no mixed precision |",
        "| optimizer | `pipeline.factories:adam`, lr 0.01, weight decay 0.0, betas [0.9, 0.999], eps 1e-08 |",
        "| schedule | `pipeline.factories:step_lr` gamma 0.5, step_size 4, stepped once per optimizer step |",
        "| evaluation | none during training |",
        "| seed | 0 |",
        "| launch | one process on cpu |",
        "| parameters | 353 |",
    ]
    # Taken as --checkpoint best: how it was chosen, with its value as the card shows numbers.
    meta["selected_as_best"] = {"metric": "mse", "mode": "max", "value": 0.123456789}
    assert _paragraphs(build_model_card(meta, {}))[3] == (
        "This is step **4**, selected as the best by `mse` (max) = 0.123457 at step 4 of 10; 353 parameters "
        "in `modelo.safetensors`."
    )
    # At the run's last step, the command trains the whole run: no --stop-at.
    meta["step"] = 10
    assert "\npython scripts/02_train.py --config config.yaml\n```" in str(build_model_card(meta, {}))


def test_a_final_training_loss_of_exactly_zero_is_carded_as_zero_and_an_unknown_one_as_na(staged_run):
    """A loss of 0.0 is a loss (a model that fits its data exactly), not a missing one."""
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    rows = []
    for final_loss in (0.0, None):
        meta["training"]["final_loss"] = final_loss
        table = str(build_model_card(meta, {})).split("## Training\n\n", 1)[1].split("\n\n", 1)[0]
        rows.append(table.splitlines()[3])
    assert rows == ["| final training loss | 0 |", "| final training loss | n/a |"]


def test_a_tab_in_a_cards_description_sections_and_sample_stays_a_tab(staged_run):
    """Tabs lay out text people wrote (a TSV row, an indented note, a sample's columns): only the
    other control characters are written as \\xNN."""
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    meta["config"]["card"]["description"] = "Columns:\tx\ty"
    card = build_model_card(meta, {}, sample="x\ty\x01", user_sections="## Notes\n\nkey\tvalue\x07\n")
    paragraphs = _paragraphs(card)
    assert paragraphs[2] == "Columns:\tx\ty"
    assert paragraphs[4:6] == ["## Notes", "key\tvalue\\x07"]
    assert "```text\nx\ty\\x01\n```" in paragraphs


def test_the_card_of_weights_in_three_shards_names_the_first_and_the_last(staged_run):
    meta = json.loads((staged_run.stage / "meta.json").read_text())
    meta["export"]["weights"] = [f"modelo-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    shards = (
        "3 shards (`modelo-00001-of-00003.safetensors` … `modelo-00003-of-00003.safetensors`, listed in "
        "`model.safetensors.index.json`)"
    )
    paragraphs = _paragraphs(build_model_card(meta, {}))
    assert paragraphs[3] == f"This is step **10**, the last step of its run; 353 parameters in {shards}."
    assert (
        "`regression-mlp` is a PyTorch model with 353 parameters built by `pipeline.tasks.regression:build_model` "
        "and trained for 10 steps on data prepared by `pipeline.tasks.regression:prepare_data`. The weights are "
        f"stored in {shards} (float64); `meta.json` records the config, metrics and provenance."
    ) in paragraphs


def test_the_loading_snippet_of_a_transformers_model_fits_its_architecture_and_tokenizer():
    """A causal LM with a tokenizer file gets a generation example; one without, the model alone;
    any other architecture is loaded by its own class, named without its module."""
    from pipeline.stage.card_parts import load_section

    strict = (
        "# Strict: every tensor of the model came from the files, and every file tensor was used.\n"
        'assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info\n'
    )
    config = {"config.json": {"sha256": A, "size": 1}}
    cases = [
        (
            "LlamaForCausalLM",
            {"tokenizer_config.json": {"sha256": B, "size": 2}},
            "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline",
            "tokenizer = AutoTokenizer.from_pretrained(folder)\n"
            "model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)\n"
            + strict
            + 'generator = pipeline("text-generation", model=model, tokenizer=tokenizer)\n'
            'print(generator("Hello", max_new_tokens=20)[0]["generated_text"])\n```',
        ),
        (
            "LlamaForCausalLM",
            {"tokenizer.json": {"sha256": B, "size": 2}},
            "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline",
            None,
        ),
        (
            "LlamaForCausalLM",
            {},
            "from transformers import AutoModelForCausalLM",
            "model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)\n"
            + strict
            + "```",
        ),
        (
            "transformers.GPT2LMHeadModel",
            {},
            "from transformers import GPT2LMHeadModel",
            "model, info = GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)\n"
            + strict
            + "model.eval()\n```",
        ),
    ]
    for architecture, tokenizer, imports, body in cases:
        meta = {"export": {"transformers": True, "architecture": architecture}}
        section = load_section(meta, {**config, **tokenizer}, "you/lm").split("\n\n")
        assert section[1] == (
            "A transformers model: `config.json` is the model's own config and `model.safetensors.index.json` "
            "maps every tensor to its file, so `from_pretrained` loads it with no code from this repository. The "
            "snippet first checks every file against this card. Pin `revision=` to a commit id (or a tag) so that "
            "what you load cannot change under you."
        )
        assert section[3] == "from huggingface_hub import snapshot_download\n" + imports, section
        assert section[4].startswith(
            'repo_id = "you/lm"\nrevision = "main"  # pin a commit id or tag, e.g. revision="<commit sha>", for '
            "a reproducible download\nfolder = Path(snapshot_download(repo_id, revision=revision))\n"
        ), section
        if body is not None:
            assert section[5] == body, section


# A staged record as 05 writes it for the session's run (one process, 10 steps, evaluated, traced),
# built here so the card's edge cases below render in-process from a known record.
_RECORD = {
    "checks": {"nonfinite_tensors": []},
    "config": {
        "card": {
            "allow_leaks": {},
            "base_model": "",
            "datasets": [],
            "description": "",
            "eval_dataset_name": "",
            "eval_dataset_type": "",
            "language": [],
            "library_name": "",
            "license": "apache-2.0",
            "pipeline_tag": "",
            "sections": "",
            "tags": ["pytorch", "safetensors", "regression"],
        },
        "checkpoint": {
            "async": True,
            "best_metric": "",
            "best_mode": "min",
            "dir": "estados_local",
            "every": 5,
            "keep_last": 1,
        },
        "data": {
            "batch_size": 4,
            "dir": "data/regression",
            "drop_last": False,
            "factory": "pipeline.tasks.regression:build_data",
            "num_workers": 0,
            "params": {
                "augment_std": 0.01,
                "noise": 0.05,
                "num_features": 3,
                "num_heldout": 16,
                "num_train": 24,
            },
            "prepare": "pipeline.tasks.regression:prepare_data",
            "sample_timeout": 0.0,
            "seed": 1234,
            "shuffle": True,
            "stream_split": "examples",
        },
        "model": {
            "factory": "pipeline.tasks.regression:build_model",
            "name": "regression-mlp",
            "params": {"dropout": 0.1, "hidden": 16},
        },
        "optimizer": {
            "factory": "pipeline.factories:adam",
            "lr": 0.01,
            "params": {"betas": [0.9, 0.999], "eps": 1e-08},
            "weight_decay": 0.0,
        },
        "outputs": {"metrics": "metrics.json", "stage": "hub_stage", "traces": ""},
        "scheduler": {"factory": "pipeline.factories:step_lr", "params": {"gamma": 0.5, "step_size": 4}},
        "training": {
            "amp": "none",
            "callbacks": [],
            "ddp_find_unused_parameters": False,
            "deterministic": True,
            "device": "cpu",
            "dtype": "float64",
            "early_stopping_patience": 0,
            "early_stopping_threshold": 0.0,
            "epochs": 0,
            "eval_every": 0,
            "grad_accum_steps": 1,
            "grad_clip": 0.0,
            "log_every": 1,
            "max_steps": 10,
            "parallel": "none",
            "seed": 0,
            "threads": 1,
        },
    },
    "export": {
        "architecture": "pipeline.tasks.mlp.MLP",
        "renamed": {},
        "total_size": 2824,
        "transformers": False,
        "weights": ["modelo.safetensors"],
    },
    "metrics": {
        "data_fingerprint": "<B>",
        "device": "cpu",
        "split": "heldout",
        "values": {"mse": 0.25, "rmse": 0.5},
    },
    "model": {"derived_buffers": [], "num_parameters": 353, "tensors": {}, "tied": []},
    "proof": None,
    "provenance": {
        "code_changes": [],
        "device": "cpu",
        "environment": {
            "cudnn_benchmark": False,
            "cudnn_deterministic": False,
            "deterministic_algorithms": True,
            "device_type": "cpu",
            "inter_op_threads": 2,
            "intra_op_threads": 1,
            "numpy": "2.4.6",
            "torch": "2.13.0+cpu",
        },
        "fingerprints": {"code": "<A>", "data": "<B>", "factories": "<C>", "sources": {}},
        "versions": {
            "cuda": None,
            "huggingface_hub": "2.4.0",
            "numpy": "2.4.6",
            "pipeline": "0.1.0",
            "platform": "linux",
            "python": "3.11.7",
            "safetensors": "0.8.0",
            "torch": "2.13.0+cpu",
        },
    },
    "repo_id": None,
    "schema": "pipeline.stage/1",
    "selected_as_best": None,
    "source_checkpoint": {
        "files": {"estado_treino.safetensors": "<C>", "modelo.safetensors": "<D>"},
        "folder": "step-00000010",
        "schema": "pipeline.checkpoint/3",
    },
    "step": 10,
    "training": {
        "changes": [],
        "final_loss": 0.5,
        "final_lr": 0.0025,
        "history_points": 10,
        "launch": {"ddp_find_unused_parameters": None, "parallel": "none", "world_size": 1},
        "lineage": [],
        "stopped": None,
        "traces": "runs/events.out.tfevents.pipeline",
    },
}


def _record() -> dict:
    return json.loads(digests(json.dumps(_RECORD)))


def _section(card, title: str) -> list[str]:
    """The paragraphs of the card's section ``title``, up to the next one."""
    paragraphs = _paragraphs(card)
    start = paragraphs.index(title) + 1
    end = next(i for i in range(start, len(paragraphs)) if paragraphs[i].startswith("## "))
    return paragraphs[start:end]


def test_a_stage_of_step_0_with_metrics_of_zero_negative_huge_and_integer_values_is_carded_as_numbers():
    """Weights saved before the first optimizer step are step 0, trained again with --stop-at 0;
    a metric of exactly 0 or below is a number, a huge one keeps its exponent, an integer stays one:
    in the table (sorted by name) and in the front matter the Hub indexes (in the record's order)."""
    meta = _record()
    meta["step"] = 0
    meta["metrics"]["values"] = {"r2": -0.25, "loss": 0.0, "perplexity": 1.5e20, "count": 3}
    card = build_model_card(meta, {})
    assert card.data.metrics == ["count", "loss", "perplexity", "r2"]
    assert [(result.metric_name, result.metric_value) for result in card.data.eval_results] == [
        ("r2", -0.25),
        ("loss", 0.0),
        ("perplexity", 1.5e20),
        ("count", 3),
    ]
    paragraphs = _paragraphs(card)
    assert paragraphs[2:4] == [
        "`regression-mlp` is a PyTorch model with 353 parameters built by `pipeline.tasks.regression:build_model` "
        "and trained for 0 steps on data prepared by `pipeline.tasks.regression:prepare_data`. The weights are "
        "stored in `modelo.safetensors` (float64); `meta.json` records the config, metrics and provenance.",
        "This is step **0**, an intermediate checkpoint of a run configured for 10 steps; 353 parameters in "
        "`modelo.safetensors`.",
    ]
    assert _section(card, "## Training")[0].splitlines()[2:4] == [
        "| steps | 0 |",
        "| final training loss | 0.5 |",
    ]
    assert _section(card, "## Metrics") == [
        "On the held-out split (`heldout`) of the prepared data (fingerprint `bbbbbbbbbbbb`), evaluated with "
        "exactly the weights below (step 0):",
        "| metric | value |\n| --- | --- |\n| count | 3 |\n| loss | 0 |\n| perplexity | 1.5e+20 |\n| r2 | -0.25 |",
        "Full-precision values are in `meta.json` under `metrics`.",
    ]
    assert _section(card, "## Reproduce")[1] == (
        "```sh\npython -c \"import json, yaml; yaml.safe_dump(json.load(open('meta.json'))['config'], "
        "open('config.yaml', 'w'))\"\npython scripts/01_prepare_data.py --config config.yaml\n"
        "python scripts/02_train.py --config config.yaml --stop-at 0\n```"
    )


def test_a_run_evaluated_with_no_best_metric_is_carded_as_evaluated_with_none_kept():
    meta = _record()
    meta["config"]["training"]["eval_every"] = 3
    assert dict(recipe_rows(meta))["evaluation"] == "every 3 optimizer steps and at step 10"
    meta["config"]["checkpoint"].update(best_metric="mse", best_mode="max")
    assert dict(recipe_rows(meta))["evaluation"] == (
        "every 3 optimizer steps and at step 10; the best by `mse` (max) kept as `--checkpoint best`"
    )


def test_a_run_of_three_launches_and_two_extensions_is_carded_and_reproduced_from_its_first():
    """Moved twice (one process, then DDP, then FSDP2), extended twice, then stopped early short of
    its length: the history starts from the first launch and lists every event in step order (the
    record lists changes and extensions apart); the progress line tells each extension and the
    stop; the reproduce command trains the first length in the first launch (one process) and
    stops at the staged step."""
    meta = _record()
    fsdp = {"parallel": "fsdp2", "world_size": 4, "ddp_find_unused_parameters": None}
    meta["step"] = 11
    meta["config"]["data"]["batch_size"] = 8
    meta["config"]["training"]["max_steps"] = 12
    meta["training"].update(
        launch=fsdp,
        changes=[
            {"item": "launch", "recorded": ONE, "now": DDP, "step": 3},
            {"item": "launch", "recorded": DDP, "now": fsdp, "step": 6},
            {"item": "intra_op_threads", "recorded": 1, "now": 2, "step": 10},
        ],
        lineage=[
            {"from_max_steps": 6, "at_step": 6, "to_max_steps": 8},
            {"from_max_steps": 8, "at_step": 8, "to_max_steps": 12},
        ],
        stopped={"step": 11, "by": "pipeline.callbacks:EarlyStopping", "reason": "mse did not improve"},
    )
    card = build_model_card(meta, {})
    kept = "(optimizer, data order and random states continued; the learning-rate schedule kept its first length)"
    assert _paragraphs(card)[3] == (
        "This is step **11**, the last step of its run; 353 parameters in `modelo.safetensors`. The run, planned "
        f"for 6 steps, was extended at step 6 to 8 {kept}. The run, planned for 8 steps, was extended at step 8 "
        f"to 12 {kept}. It stopped early at step 11: mse did not improve (pipeline.callbacks:EarlyStopping)."
    )
    rows = _section(card, "## Training")[0].splitlines()
    assert (
        rows[4]
        == "| effective batch | 8 rows per optimizer step; each micro-batch split over 4 processes, 2 rows each |"
    )
    assert rows[11:14] == [
        "| launch | 4 processes (FSDP2) on cpu |",
        "| history | trained in one process; moved to 2 processes (DDP, find_unused_parameters) after step 3; "
        "moved to 4 processes (FSDP2) after step 6; extended from 6 to 8 steps after step 6; extended from 8 to 12 "
        "steps after step 8; intra_op_threads changed from 1 to 2 after step 10 |",
        "| parameters | 353 |",
    ]
    reproduce = _section(card, "## Reproduce")
    assert (
        reproduce[1].splitlines()[3]
        == "python scripts/02_train.py --config config.yaml --set training.max_steps=6"
    )
    assert reproduce[4].startswith(
        "(the libraries recorded: huggingface_hub 2.4.0, numpy 2.4.6, pipeline 0.1.0, platform linux, python "
        "3.11.7, safetensors 0.8.0, torch 2.13.0+cpu). This run was extended (`training.lineage` in `meta.json`): "
        "after the first command, continue it with `--resume latest --extend-to N` at each step the lineage lists, "
        "stopping at step 11. The checkpoint's"
    ), reproduce[4]
