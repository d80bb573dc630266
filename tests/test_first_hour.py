"""A newcomer's first hour: every config value validated before use, each config its own
outputs, printed commands that run as printed, one rule for changed code, and refusals
that are one line naming the file or the key."""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import CheckpointStore, resolve
from pipeline.config import config_from_dict, load_config, parse_set_overrides
from pipeline.errors import CheckpointError, CodeChanged, ConfigError, FactoryFailed, OutOfMemory
from pipeline.factories import resolve as resolve_factory
from pipeline.hashing import sha256_file
from pipeline.provenance import check_code_unchanged, counted_sources

from support import REPO, one_line_error, run_python, run_script, save_parts, script_env

CONFIG = REPO / "config.yaml"
DEEP = "[" * 3000 + "]" * 3000


# -- every value validated, in process ---------------------------------------------------------


@pytest.mark.parametrize(
    "items, expected",
    [
        pytest.param([f"model.params={DEEP}"], r"nested deeper than 64 levels", id="3000-deep"),
        ([f"model.params.x={'[' * 20}1{']' * 20}"], r"model\.params is nested deeper than 16 levels"),
        (["training.seed=99999999999999999999999"], r"training\.seed must be < 2\*\*63"),
        (["model.params.extra=[1, .nan]"], r"model\.params\.extra\[1\] must be a finite number \(got nan\)"),
        (["optimizer.lr=.inf"], r"optimizer\.lr must be a finite number > 0 \(got inf\)"),
        (["training.grad_clip=.nan"], r"training\.grad_clip must be a finite number"),
        (["training.max_steps="], r"--set 'training\.max_steps=': no value given"),
        (["training.max_steps=null"], r"no value given"),
        (["data.params.when=2024-01-01"], r"data\.params\.when is a date"),
        (["model.params={1: 2}"], r"model\.params has the key 1: keys must be non-empty strings"),
        (
            ["model.params.big=18446744073709551616"],
            r"model\.params\.big is 18446744073709551616, beyond the 64-bit",
        ),
        (["training.threads=4294967296"], r"training\.threads must be < 2\*\*31"),
    ],
)
def test_bad_values_are_refused_naming_the_key(items, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(CONFIG, parse_set_overrides(items))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("training:\n  max_steps: 3\n  max_steps: 4\n", r"at line 3: the key 'max_steps' is given twice"),
        ("training:\n  max_steps:\n", r"training\.max_steps has no value"),
        ("base: &b {hidden: 8}\nmodel:\n  params:\n    <<: *b\n    hidden: 4\n", r"unknown section 'base'"),
        (
            "training:\n  <<: {max_steps: 3}\n  <<: {max_steps: 5}\n",
            r"at line 3: the key '<<' is given twice",
        ),
    ],
)
def test_duplicate_keys_and_empty_values_in_a_file_are_refused(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_config(path)


def test_a_yaml_merge_key_may_be_overridden_key_by_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  params:\n    <<: {hidden: 8, dropout: 0.0}\n    hidden: 4\n")
    assert load_config(path).model.params == {"hidden": 4, "dropout": 0.0}


def test_a_section_written_without_a_key_under_it_takes_the_command_lines_keys(tmp_path):
    """``training:`` with its keys commented out is the section's defaults, as a section left out
    is: an override of one of its keys (``--max-steps 3``) fills it, never 'not a mapping'."""
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  # max_steps: 10\ncheckpoint:\n  every: 5\n")
    assert load_config(path).training.max_steps == 10
    config = load_config(path, {"training.max_steps": 3, "card.license": "mit"})
    assert config.training.max_steps == 3 and config.card.license == "mit" and config.checkpoint.every == 5


def test_factories_are_checked_for_their_signature_result_and_failures():
    config = load_config(CONFIG)
    with pytest.raises(ConfigError, match=r"model\.factory: os:getcwd cannot be called as f\(config\)"):
        resolve_factory("os:getcwd", "model.factory")(config)
    with pytest.raises(
        ConfigError, match=r"model\.factory: builtins:str returned str, not a torch\.nn\.Module"
    ):
        resolve_factory("builtins:str", "model.factory", returns=torch.nn.Module)(config)
    with pytest.raises(
        FactoryFailed, match=r"model\.factory os:listdir failed: TypeError: .*--debug"
    ) as failed:
        resolve_factory("os:listdir", "model.factory")(config)
    assert isinstance(failed.value.__cause__, TypeError)  # what --debug prints
    model = torch.nn.Linear(2, 2)
    with pytest.raises(
        ConfigError, match=r"optimizer\.params\.eps must be a finite number > 0 \(got -1\.0\)"
    ):
        resolve_factory("pipeline.factories:adam", "optimizer.factory")(
            model, load_config(CONFIG, {"optimizer.params.eps": -1})
        )
    too_big = load_config(CONFIG, {"model.params.hidden": 100_000_000_000})
    with pytest.raises(
        OutOfMemory, match=r"^out of memory in model\.factory .*asked for 1\.2 TB.*model\.params"
    ):
        resolve_factory(too_big.model.factory, "model.factory")(too_big)


# -- each input of the acceptance list: one error line, exit 2, nothing written ------------------


@pytest.mark.parametrize(
    "item, expected",
    [
        pytest.param(f"model.params={DEEP}", "nested deeper than 64 levels", id="3000-deep"),
        ("training.seed=99999999999999999999999", "training.seed must be < 2**63"),
        ("model.params.dropout=.nan", "model.params.dropout must be a finite number"),
        ("optimizer.params.eps=-1", "optimizer.params.eps must be a finite number > 0"),
        ("model.params.hidden=100000000000", "out of memory in model.factory"),
        ("model.factory=os:getcwd", "model.factory: os:getcwd cannot be called as f(config)"),
        ("optimizer.lr=.inf", "optimizer.lr must be a finite number > 0 (got inf)"),
        ("training.max_steps=", "no value given"),
    ],
)
def test_each_bad_input_is_one_line_exit_2_and_writes_nothing(data_dir, tmp_path, item, expected):
    result = run_script(
        "02_train.py",
        "--set",
        f"data.dir={data_dir}",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--quiet",
        "--set",
        item,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert expected in one_line_error(result)
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").glob("step-*"))


def test_debug_prints_the_traceback_behind_the_line(data_dir, tmp_path):
    result = run_script(
        "02_train.py",
        "--set",
        f"data.dir={data_dir}",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--quiet",
        "--set",
        "model.factory=os:listdir",
        "--debug",
    )
    assert result.returncode == 2
    assert "Traceback" in result.stderr and result.stderr.rstrip().splitlines()[-1].startswith(
        "error: model.factory os:listdir failed: TypeError"
    )


# -- each config its own outputs; printed commands run as printed --------------------------------


def test_output_keys_are_derived_from_the_config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(CONFIG, tmp_path / "config.yaml")
    (tmp_path / "mycnn").mkdir()
    shutil.copy(CONFIG, tmp_path / "mycnn" / "config.yaml")
    shutil.copy(CONFIG, tmp_path / "sweep-lr3.yaml")

    def outputs(path) -> tuple[str, str, str]:
        config = load_config(path)
        return config.checkpoint.dir, config.outputs.metrics, config.outputs.stage

    assert outputs("config.yaml") == outputs(CONFIG) == ("estados_local", "metrics.json", "hub_stage")
    assert outputs("mycnn/config.yaml") == (
        "runs/mycnn/estados_local",
        "runs/mycnn/metrics.json",
        "runs/mycnn/hub_stage",
    )
    assert outputs(tmp_path / "sweep-lr3.yaml")[0] == "runs/sweep-lr3/estados_local"
    assert load_config("config.yaml").command_args == ()
    given = load_config("mycnn/config.yaml", {"training.max_steps": 20, "data.dir": "my data"})
    assert given.command_args == (
        "--config",
        "mycnn/config.yaml",
        "--set",
        "training.max_steps=20",
        "--set",
        "data.dir=my data",
    )
    # Named in the file or by --set, they win; an old checkpoint's config (no outputs) keeps the defaults.
    assert load_config("mycnn/config.yaml", {"outputs.stage": "s"}).outputs.stage == "s"
    base = CONFIG.read_text()
    (tmp_path / "named.yaml").write_text(
        base.replace("checkpoint:\n", "checkpoint:\n  dir: my/ck\n")
        + "\noutputs:\n  metrics: my/m.json\n  stage: my/st\n"
    )
    assert outputs("named.yaml") == ("my/ck", "my/m.json", "my/st")
    (tmp_path / "partly.yaml").write_text(base + "\noutputs:\n  stage: my/st\n")
    assert outputs("partly.yaml") == ("runs/partly/estados_local", "runs/partly/metrics.json", "my/st")
    assert config_from_dict({}).outputs.metrics == "metrics.json"


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
        if ".lock" not in p.name
    }


def test_two_configs_in_one_folder_keep_their_outputs_apart_and_hints_run_as_printed(staged_run, run_copy):
    """The default pipeline's folder, then another config's 02, 04, 05 there with only
    --config: the default outputs stay byte for byte; 05's hint, run as printed, works."""
    run = run_copy(staged_run)
    (run.root / "other").mkdir()
    shutil.copy(CONFIG, run.root / "other" / "config.yaml")
    default = {name: _snapshot(run.root / name) for name in ("estados_local", "hub_stage")}
    default["metrics.json"] = run.metrics.read_bytes()

    def script(name: str, *args: str) -> subprocess.CompletedProcess:
        return run_python(
            [REPO / "scripts" / name, "--config", "other/config.yaml", *args], cwd=run.root, env=script_env()
        )

    assert script("02_train.py", "--quiet", "--stop-at", "5").returncode == 0
    assert script("04_evaluate.py").returncode == 0
    assert script("02_train.py", "--quiet", "--resume", "latest").returncode == 0
    line = one_line_error(script("05_stage.py"))  # its metrics.json evaluates step 5, not the newest, 10
    printed = line.split("rerun ", 1)[1].split(", or pass --no-metrics")[0]
    assert (
        "--config other/config.yaml" in printed
        and "--checkpoint runs/other/estados_local/step-00000010" in printed
    )
    assert (
        subprocess.run(shlex.split(printed), cwd=run.root, env=script_env(), capture_output=True).returncode
        == 0
    )
    assert script("05_stage.py").returncode == 0
    assert (run.root / "runs/other/hub_stage/MANIFEST.sha256").is_file()
    assert json.loads((run.root / "runs/other/metrics.json").read_text())["step"] == 10
    now = {name: _snapshot(run.root / name) for name in ("estados_local", "hub_stage")}
    now["metrics.json"] = run.metrics.read_bytes()
    assert now == default
    # 06 publishes the stage of the config it is given.
    published = script("06_publish.py", "--repo-id", "x/y", "--dry-run", "--endpoint", "http://127.0.0.1:9")
    assert "runs/other/hub_stage" in published.stdout + published.stderr, published.stdout + published.stderr


# -- code fingerprints per file: resume and stage apply one rule -------------------------------


def test_a_changed_data_module_is_named_alike_by_resume_and_stage(data_dir, tmp_path):
    (tmp_path / "my_data.py").write_text(
        "from pipeline.tasks.regression import build_data, prepare_data  # noqa\n"
    )
    args = (
        "--config",
        str(CONFIG),
        "--set",
        f"data.dir={data_dir}",
        "--set",
        "data.factory=my_data:build_data",
        "--set",
        "training.max_steps=4",
        "--quiet",
    )

    def script(name: str, *extra: str) -> subprocess.CompletedProcess:
        return run_python([REPO / "scripts" / name, *args[:-1], *extra], cwd=tmp_path, env=script_env())

    assert script("02_train.py", "--quiet", "--stop-at", "2").returncode == 0
    trained = sha256_file(tmp_path / "my_data.py")
    (tmp_path / "my_data.py").write_text((tmp_path / "my_data.py").read_text() + "# a comment\n")
    now = sha256_file(tmp_path / "my_data.py")
    lines = [
        one_line_error(script("02_train.py", "--quiet", "--resume", "latest")),
        one_line_error(script("05_stage.py", "--no-metrics")),
    ]
    for line in lines:
        assert (
            f"my_data.py (the data factory) changed since step 2 was trained (SHA-256 {trained} then, {now} now)"
            in line
        ), line
        # Where the bytes it was trained with are found again.
        assert "restore it (git log -p -- my_data.py shows its earlier versions)" in line, line
    assert (
        "--allow-environment-change" in lines[0] and "stage a checkpoint trained with this code" in lines[1]
    )
    assert not (tmp_path / "hub_stage").exists()  # a model that ships its code: refused, nothing staged
    resumed = script("02_train.py", "--quiet", "--resume", "latest", "--allow-environment-change")
    assert resumed.returncode == 0, resumed.stderr
    assert script("05_stage.py", "--no-metrics").returncode == 0  # step 4 was trained with this code


def test_a_checkpoint_without_per_file_fingerprints_is_held_to_its_one_hash():
    config = load_config(CONFIG)
    meta = {"step": 7, "fingerprints": {"factories": "0" * 64}}
    with pytest.raises(CodeChanged, match=r"predates per-file fingerprints.*restore it"):
        check_code_unchanged(meta, config, use="stage")
    recorded = counted_sources(config)
    check_code_unchanged({"step": 7, "fingerprints": {"sources": recorded}}, config, use="resume")
    first = next(iter(recorded))
    with pytest.raises(CodeChanged, match=rf"^{first} \(the model's code\) changed since step 7"):
        check_code_unchanged(
            {"step": 7, "fingerprints": {"sources": {**recorded, first: "0" * 64}}}, config, use="resume"
        )
    with pytest.raises(CodeChanged, match=r"^gone\.py counted for step 7"):
        check_code_unchanged(
            {"step": 7, "fingerprints": {"sources": {**recorded, "gone.py": "0" * 64}}}, config, use="resume"
        )


# -- symlinked step folders, and OS errors that name their path --------------------------------

META = save_parts()


def test_a_symlinked_step_folder_is_refused_by_every_reader_and_never_pruned(tmp_path, caplog):
    store = CheckpointStore(tmp_path / "ck", keep_last=1)
    elsewhere = tmp_path / "elsewhere"
    with store:
        store.save(1, {"w": torch.zeros(2)}, {"s": torch.zeros(1)}, META)
        store.path_for(1).rename(elsewhere)
        store.path_for(1).symlink_to(elsewhere)
        for spec in ("latest", store.path_for(1)):
            with pytest.raises(CheckpointError, match=r"step-00000001 is not loaded: it is a symbolic link"):
                resolve(spec, store.root)
        with caplog.at_level(logging.WARNING):
            store.save(2, {"w": torch.ones(2)}, {"s": torch.zeros(1)}, META)
    assert sorted(p.name for p in store.root.iterdir()) == [".lock", "step-00000001", "step-00000002"]
    assert store.path_for(1).is_symlink() and (elsewhere / "meta.json").is_file()  # neither moved nor deleted
    assert any("not pruning" in r.getMessage() and "symbolic link" in r.getMessage() for r in caplog.records)
    assert resolve("latest", store.root)[1] == []  # never offered as the older checkpoint to fall back on


def test_a_fresh_runs_lock_on_a_full_disk_names_the_lock_file(tmp_path):
    from test_os_errors import fill, tmpfs

    from pipeline.errors import describe_os_error

    with tmpfs(tmp_path / "disk") as disk:
        fill(disk)
        store = CheckpointStore(disk / "estados_local")
        with pytest.raises(OSError) as failed:
            store.acquire()
        assert (
            describe_os_error(failed.value)
            == f"{disk / 'estados_local' / '.lock'}: no space left on the device"
        )


# -- what a person reads -----------------------------------------------------------------------


def test_the_proof_report_counts_checks_and_says_when_the_loss_stayed_equal():
    from pipeline.proof import describe

    control = {
        "result": "detected",
        "why_exercised": "",
        "diverged_checks": ["a"],
        "first_divergent_loss_step": None,
    }
    report = {
        "boundary": {"steps": 10, "cut": 4, "reason": "mid-epoch"},
        "protocol": {"tolerance": {"atol": 0}},
        "checks": {
            "positive": [
                {
                    "name": "weights",
                    "component": "model",
                    "passed": False,
                    "max_abs_diff": None,
                    "first_difference": None,
                    "note": "",
                }
            ]
        },
        "components": {
            "negative": {
                "rng": control,
                "data": {**control, "diverged_checks": ["a", "b"], "first_divergent_loss_step": 5},
            },
            "positive": {},
        },
    }
    text = "\n".join(describe(report))
    assert "None" not in text and "in 1 checks" not in text, text
    assert (
        "diverged in 1 check; the loss stays equal" in text
        and "diverged in 2 checks; the loss first differs at step 5" in text
        and "values not comparable" in text
    )


def test_04_and_05_take_the_checkpoint_dir_02_was_given_and_their_hints_keep_it(trained_run, run_copy):
    run = run_copy(trained_run)
    (run.root / "elsewhere").mkdir()
    run.checkpoint_dir.rename(run.root / "elsewhere" / "ck")
    flag = ("--checkpoint-dir", "elsewhere/ck")
    line = run.refused("05_stage.py", *flag)  # not evaluated yet: the hint runs 04 on that folder
    printed = line.split("run ", 1)[1].split(" first,")[0]
    assert "checkpoint.dir=elsewhere/ck" in printed, line
    assert run_python(shlex.split(printed)[1:], cwd=run.root, env=script_env()).returncode == 0
    assert json.loads(run.metrics.read_text())["checkpoint"] == "elsewhere/ck/step-00000010"
    run.ok("04_evaluate.py", *flag)
    run.ok("05_stage.py", *flag)
    assert json.loads((run.stage / "meta.json").read_text())["metrics"]["values"]
    assert "no committed checkpoint in estados_local/" in run.refused("04_evaluate.py")
