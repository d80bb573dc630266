"""scripts/03_verify_resume.py proves the resume exact and proves its own sensitivity.

Every proof here is the real command in a subprocess, run from an empty working folder so
that a stray write to ``estados_local/`` would show. Factories of the tests' own tasks
(tests/helpers/proof_factories.py) are plugged in by import path, as a user's would be.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import TREE_PATH, assert_checkpoints_bitwise_equal, run_python

REPO = Path(__file__).resolve().parents[1]

PYTHON = sys.executable
CONTROLS = ("rng", "optimizer", "scheduler", "data")


def _env() -> dict[str, str]:
    # The tree under test and tests/ (proof_factories must import in the proof and every leg).
    return {**os.environ, "PYTHONPATH": TREE_PATH, "PYTHONUNBUFFERED": "1"}


def _script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    # The timeout only stops a hung run from blocking the suite; nothing asserts on time.
    return run_python(
        [REPO / "scripts" / name, "--config", REPO / "config.yaml", *args], cwd=cwd, env=_env(), timeout=900
    )


@dataclass
class Proof:
    result: subprocess.CompletedProcess
    output: Path
    workdir: Path

    @property
    def summary(self) -> dict:
        return json.loads(self.result.stdout.strip().splitlines()[-1])

    @property
    def report(self) -> dict:
        return json.loads((self.output / "verification.json").read_text())


def _prove(data_dir: Path, workdir: Path, *args: str) -> Proof:
    workdir.mkdir(parents=True, exist_ok=True)
    output = workdir / "proof"
    result = _script(
        "03_verify_resume.py", "--set", f"data.dir={data_dir}", "--output", str(output), *args, cwd=workdir
    )
    return Proof(result, output, workdir)


# For the tests' own tasks: CPU kernels are deterministic either way, and torch's deterministic
# mode costs each of the seven processes about a second of imports on a 2-core machine.
FAST = ("--set", "training.deterministic=false")
# Two processes (one per phase) instead of seven: the legs end bitwise as in processes of their own
# (test_legs_sharing_a_process_end_bitwise_where_each_in_its_own_did), and each start costs seconds.
PACKED = ("--jobs", "1")


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data") / "data"
    result = _script("01_prepare_data.py", "--set", f"data.dir={folder}", cwd=folder.parent)
    assert result.returncode == 0, result.stderr
    return folder


# The tests that read the default proof run on one xdist worker, so it is built once.
DEFAULT_PROOF = pytest.mark.xdist_group("default-proof")


@pytest.fixture(scope="module")
def default_proof(data_dir, tmp_path_factory) -> Proof:
    return _prove(data_dir, tmp_path_factory.mktemp("default"))


@DEFAULT_PROOF
def test_default_config_is_proven_bitwise_with_all_four_omissions_detected(default_proof):
    assert default_proof.result.returncode == 0, default_proof.result.stdout + default_proof.result.stderr
    assert default_proof.summary == {
        "device": "cpu",
        "all_checks_passed": True,
        "positive": True,
        "negative_divergence_detected": True,
        "failed_components": [],
        "report": str(default_proof.output / "verification.json"),
    }
    report = default_proof.report
    assert report["completed"] and report["all_checks_passed"] and report["positive"]
    assert report["negative_divergence_detected"]
    for name in CONTROLS:
        control = report["components"]["negative"][name]
        assert control["result"] == "detected", (name, control)
        assert control["diverged_checks"], name
    assert report["components"]["negative"]["scaler"]["result"] == "not exercised"
    # Measured differences are reported, zero included, and zero means bitwise here.
    positive = report["checks"]["positive"]
    assert {c["name"] for c in positive} >= {
        "final.model",
        "final.optimizer",
        "final.scheduler",
        "final.data",
        "final.rng",
        "final.losses",
        "final.learning_rates",
        "after_cut.data_order",
        "boundary.rng_next_draws",
        "final.rng_next_draws",
        "final.metric",
    }
    assert all(c["passed"] and c["max_abs_diff"] == 0.0 for c in positive), positive
    assert report["protocol"]["tolerance"] == {"atol": 0.0, "rtol": 0.0, "mode": "bitwise"}


@DEFAULT_PROOF
def test_default_cut_lands_inside_an_epoch_with_a_reshuffle_after_the_resume(default_proof):
    boundary = default_proof.report["boundary"]
    # 24 rows in batches of 4: six steps per epoch, so step 5 leaves the cursor mid-pass.
    assert (boundary["steps"], boundary["cut"]) == (10, 5)
    assert boundary["sampler_at_cut"]["cursor"] == 20 and boundary["sampler_at_cut"]["epoch"] == 0
    assert boundary["first_step_of_a_new_epoch_after_cut"] == 7


@DEFAULT_PROOF
def test_report_records_environment_sources_and_every_leg_command(default_proof):
    report, output = default_proof.report, default_proof.output
    assert (
        report["environment"]["python"] and report["environment"]["torch"] and report["environment"]["numpy"]
    )
    reproduced = report["environment"]["reproduced"]
    assert reproduced["intra_op_threads"] == 1 and reproduced["deterministic_algorithms"] is True
    assert {"inter_op_threads", "cudnn_deterministic", "cudnn_benchmark", "device_type"} <= set(reproduced)
    sources = report["sources"]
    assert len(sources["config"]["sha256"]) == 64 and len(sources["data"]["fingerprint"]) == 64
    assert "pipeline/train.py" in sources["package"]["files"]
    assert "scripts/03_verify_resume.py" in sources["scripts"]
    legs = report["protocol"]["legs"]
    assert set(legs) == {"continuous", "cut", "resume", *(f"omit-{c}" for c in CONTROLS)}
    for name, leg in legs.items():
        assert leg["command"][0] == PYTHON and leg["exit_code"] == 0, name
        assert json.loads((output / name / "summary.json").read_text())["leg"] == name
    assert legs["omit-data"]["omit"] == ["data"] and legs["resume"]["omit"] == []
    for leg, step in (("continuous", 10), ("cut", 5), ("resume", 10)):
        assert (output / leg / "checkpoints" / f"step-{step:08d}" / "meta.json").is_file()
    assert set(report["final_metrics"]) == set(legs)


@DEFAULT_PROOF
def test_legs_sharing_a_process_with_two_dataloader_workers_end_bitwise_where_each_in_its_own_did(
    default_proof, data_dir, tmp_path
):
    """--jobs 1: one process per phase (continuous then cut; resume, first in its fresh
    interpreter, then every control), and the samples read by 2 DataLoader workers. Every leg
    ends bitwise as in the default proof, where each leg had a process of its own and the
    samples were read in the training process, with the same verdict (omit-data diverges:
    the loader's position is really restored)."""
    packed = _prove(data_dir, tmp_path, "--jobs", "1", "--set", "data.num_workers=2")
    assert packed.result.returncode == 0, packed.result.stdout + packed.result.stderr
    assert packed.report["protocol"]["data"] == {
        "mode": "dataset",
        "num_workers": 2,
        "stream_split": None,
        "source": "pipeline.tasks.regression.AugmentedRows",
    }
    assert (
        "inputs: dataset (pipeline.tasks.regression.AugmentedRows, 2 DataLoader workers)"
        in packed.result.stdout
    )
    assert default_proof.report["protocol"]["data"]["num_workers"] == 0
    assert (
        "running resume, omit-rng, omit-optimizer, omit-scheduler, omit-data (1 process)"
        in packed.result.stdout
    )
    legs, alone = packed.report["protocol"]["legs"], default_proof.report["protocol"]["legs"]
    specs = {name: [arg for arg in leg["command"] if arg.endswith("spec.json")] for name, leg in legs.items()}
    assert (
        specs["continuous"]
        == specs["cut"]
        == [str(packed.output / n / "spec.json") for n in ("continuous", "cut")]
    )
    assert (
        specs["resume"]
        == specs["omit-data"]
        == [str(packed.output / n / "spec.json") for n in ("resume", *(f"omit-{c}" for c in CONTROLS))]
    )
    assert all(len([a for a in leg["command"] if a.endswith("spec.json")]) == 1 for leg in alone.values())
    for name in legs:
        step = 5 if name == "cut" else 10
        assert_checkpoints_bitwise_equal(
            default_proof.output / name / "checkpoints" / f"step-{step:08d}",
            packed.output / name / "checkpoints" / f"step-{step:08d}",
        )
        assert "error" not in (packed.output / name / "log.txt").read_text(), name  # each leg logged apart
    assert packed.report["components"] == default_proof.report["components"]
    assert packed.report["final_metrics"] == default_proof.report["final_metrics"]


def test_a_leg_failing_in_a_shared_process_is_named_and_the_legs_after_it_never_run(data_dir, tmp_path):
    proof = _prove(
        data_dir,
        tmp_path,
        "--set",
        "data.factory=proof_factories:build_once_per_process_data",
        "--jobs",
        "1",
        *FAST,
    )
    assert proof.result.returncode == 2, proof.result.stdout + proof.result.stderr
    line = _one_line_error(proof.result)
    assert "leg cut exited with code 2: error: this task's data can be built once per process" in line, line
    report = json.loads((proof.output / "verification.json").read_text())
    assert report["completed"] is False and report["all_checks_passed"] is False
    codes = {name: leg["exit_code"] for name, leg in report["protocol"]["legs"].items()}
    assert codes == {
        "continuous": 0,
        "cut": 2,
        **{name: None for name in codes if name not in ("continuous", "cut")},
    }
    assert (proof.output / "cut" / "log.txt").read_text().strip().endswith("built once per process")
    assert not (proof.output / "resume" / "log.txt").exists()


@DEFAULT_PROOF
def test_proof_writes_nothing_outside_its_output_folder(default_proof):
    # config.yaml points checkpoint.dir at estados_local/, relative to the working folder.
    assert sorted(p.name for p in default_proof.workdir.iterdir()) == ["proof"]


@DEFAULT_PROOF
def test_rerun_into_an_existing_output_exits_2_and_leaves_it_byte_for_byte(default_proof, data_dir):
    before = {p: p.read_bytes() for p in default_proof.output.rglob("*") if p.is_file()}
    again = _prove(data_dir, default_proof.workdir)
    assert again.result.returncode == 2
    assert "already exists" in _one_line_error(again.result)
    assert {p: p.read_bytes() for p in default_proof.output.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("args", [["--cut", "10"], ["--steps", "11"]], ids=["cut-at-N", "steps-beyond-max"])
def test_cut_or_steps_outside_the_run_is_refused_before_the_output_exists(data_dir, tmp_path, args):
    proof = _prove(data_dir, tmp_path, *args)
    assert proof.result.returncode == 2
    assert args[0] in _one_line_error(proof.result)
    assert not proof.output.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--nproc-per-node", "2", "--set", "training.parallel=none"],
            "needs training.parallel auto, ddp or fsdp2",
        ),
        (["--nproc-per-node", "1", "--set", "training.parallel=ddp"], "--nproc-per-node must be >= 2"),
        (
            ["--nproc-per-node", "2", "--set", "training.parallel=ddp", "--jobs", "2"],
            "--jobs applies to single-process",
        ),
    ],
    ids=["not-parallel", "one-process", "jobs"],
)
def test_a_torchrun_proof_that_cannot_run_is_refused_before_the_output_exists(
    data_dir, tmp_path, args, message
):
    proof = _prove(data_dir, tmp_path, *args)
    assert proof.result.returncode == 2
    assert message in _one_line_error(proof.result)
    assert not proof.output.exists()


def test_unprepared_data_is_refused_with_a_hint_to_run_01(tmp_path):
    proof = _prove(tmp_path / "no-data", tmp_path / "work")
    assert proof.result.returncode == 2
    assert "01_prepare_data" in _one_line_error(proof.result)
    assert not proof.output.exists()


@pytest.mark.heavy
def test_sampler_that_forgets_its_position_fails_the_proof_naming_data(data_dir, tmp_path):
    proof = _prove(
        data_dir, tmp_path, "--set", "data.factory=proof_factories:build_forgetful_data", *FAST, *PACKED
    )
    assert proof.result.returncode == 1, proof.result.stdout + proof.result.stderr
    summary, report = proof.summary, proof.report
    assert summary["positive"] is False and summary["all_checks_passed"] is False
    # The restored sampler differs from the saved one: data is named first, before its consequences.
    assert summary["failed_components"][0] == "data"
    assert report["components"]["positive"]["data"] == "diverged"
    boundary_data = next(c for c in report["checks"]["positive"] if c["name"] == "boundary.data")
    assert not boundary_data["passed"] and boundary_data["first_difference"].startswith("sampler/")
    assert "first difference in data" in proof.result.stdout


@pytest.mark.heavy
def test_unexercised_rng_passes_and_a_control_that_cannot_diverge_fails_with_exit_1_naming_it(
    data_dir, tmp_path
):
    """One proof, two verdicts: the run draws no randomness at all (quiet data, no dropout, no
    shuffle), so leaving RNG out is "not exercised", which is not a failure; and the settling
    scheduler's control cannot diverge, which is. Only the scheduler is named."""
    proof = _prove(
        data_dir,
        tmp_path,
        "--set",
        "data.factory=proof_factories:build_quiet_data",
        "--set",
        "model.params.dropout=0.0",
        "--set",
        "data.shuffle=false",
        "--set",
        "scheduler.factory=proof_factories:settling_scheduler",
        "--steps",
        "10",
        "--cut",
        "5",
        *FAST,
        *PACKED,
    )
    assert proof.result.returncode == 1, proof.result.stdout + proof.result.stderr
    summary, controls = proof.summary, proof.report["components"]["negative"]
    assert summary["positive"] is True and summary["negative_divergence_detected"] is False
    assert summary["all_checks_passed"] is False and summary["failed_components"] == ["scheduler"]
    scheduler = controls["scheduler"]
    assert (
        scheduler["result"] == "not detected"
        and scheduler["exercised"]
        and scheduler["diverged_checks"] == {}
    )
    assert controls["rng"]["result"] == "not exercised" and not controls["rng"]["exercised"]
    # The RNG control still ran and was compared: leaving RNG out changed nothing at all.
    assert (
        proof.report["protocol"]["legs"]["omit-rng"]["exit_code"] == 0
        and controls["rng"]["diverged_checks"] == {}
    )
    assert [controls[c]["result"] for c in ("optimizer", "data")] == ["detected"] * 2


def test_a_comparison_fails_on_any_difference_beyond_atol_and_measures_it():
    import torch

    from pipeline.proof.compare import compare

    same = compare(
        "x", "model", {"w": torch.tensor([1.0, 2.0]), "n": 3}, {"w": torch.tensor([1.0, 2.0]), "n": 3}, 0.0
    )
    assert same.passed and same.max_abs_diff == 0.0 and same.differing == 0
    off = compare(
        "x", "model", {"w": torch.tensor([1.0, 2.0]), "n": 3}, {"w": torch.tensor([1.0, 2.5]), "n": 3}, 0.0
    )
    assert not off.passed and off.max_abs_diff == 0.5 and off.differing == 1 and off.first_difference == "w"
    assert compare("x", "model", {"w": torch.tensor([2.0])}, {"w": torch.tensor([2.5])}, 0.5).passed
    assert not compare("x", "model", 0.0, -0.0, 0.0).passed  # bitwise at atol 0
    assert not compare("x", "rng", {"n": 3}, {"n": 4}, 10.0).passed  # counters match exactly at any atol


def test_a_torchrun_proof_refuses_what_it_cannot_prove_in_one_line_before_its_output_exists(tmp_path):
    """What the torchrun proof cannot prove is refused, each in one whole line, before its
    output exists: one process, a negative or infinite tolerance, fp16 under torchrun, a config
    that runs training.parallel none; two processes, a zero tolerance and training.parallel
    auto pass on to the data's check."""
    from pipeline.config import load_config
    from pipeline.errors import ConfigError, DataError, PipelineError
    from pipeline.proof.distributed import verify_resume_distributed

    output = tmp_path / "proof"
    data = {"data.dir": str(tmp_path / "no-data")}

    def refused(nproc: int, atol: float = 0.0, **overrides: str) -> tuple[type, str]:
        config = load_config(REPO / "config.yaml", {**data, **overrides})
        with pytest.raises(PipelineError) as error:
            verify_resume_distributed(config, output=output, nproc=nproc, atol=atol, echo=None)
        assert not output.exists()
        return type(error.value), str(error.value).replace(config.source, "CONFIG")

    assert refused(1, **{"training.parallel": "ddp"}) == (
        ConfigError,
        "--nproc-per-node must be >= 2 to prove a distributed resume (got 1); "
        "one process is the plain proof (leave --nproc-per-node out)",
    )
    assert refused(2, -0.5, **{"training.parallel": "ddp"}) == (
        ConfigError,
        "--atol must be a finite number >= 0 (got -0.5)",
    )
    assert refused(2, float("inf"), **{"training.parallel": "auto"}) == (
        ConfigError,
        "--atol must be a finite number >= 0 (got inf)",
    )
    assert refused(2, **{"training.parallel": "ddp", "training.amp": "fp16"}) == (
        ConfigError,
        "CONFIG: training.amp 'fp16' is not supported under torchrun",
    )
    assert refused(2, **{"training.parallel": "none"}) == (
        ConfigError,
        "CONFIG: --nproc-per-node needs training.parallel auto, ddp or fsdp2 (--set training.parallel=auto)",
    )
    kind, line = refused(2, **{"training.parallel": "auto"})
    assert kind is DataError and line.startswith(f"no prepared data in {tmp_path / 'no-data'}/: run "), line
