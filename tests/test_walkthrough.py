"""The front door as a new user walks through it: the README's Python blocks run as written
in a fresh clone and publish, the scripts say in one line how to get the project's
environment, and `make demo` leaves the README's commands free to run after it."""

from __future__ import annotations

import importlib.util
import json
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from localhub import LocalHub
from pipeline.config import derived_outputs, load_config

from support import REPO, one_line_error, run_python, script_env

PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def python_blocks(page: Path) -> list[str]:
    return PYTHON_BLOCK.findall(page.read_text(encoding="utf-8"))


def fresh_clone(root: Path) -> Path:
    """What a clone holds that the README's Python uses: config.yaml, and an empty estados_local/."""
    clone = root / "clone"
    (clone / "estados_local").mkdir(parents=True)
    shutil.copy(REPO / "config.yaml", clone / "config.yaml")
    return clone


@pytest.mark.heavy
def test_the_readme_python_blocks_run_as_one_script_and_publish_then_the_stage_doc_turns_metrics_off(
    tmp_path,
):
    blocks = python_blocks(REPO / "README.md")
    walk = "\n".join(blocks)
    assert "evaluate_checkpoint" in walk and "publish(" in walk, "the walk-through covers 01 to 06"
    clone, token = fresh_clone(tmp_path), f"walk-{secrets.token_hex(8)}"
    (tmp_path / "readme.py").write_text(walk, encoding="utf-8")
    with LocalHub(tmp_path / "hub", token=token) as hub:
        env = script_env(HF_TOKEN=token, HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf_home"))
        result = run_python([tmp_path / "readme.py"], cwd=clone, env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        staged = json.loads((clone / "hub_stage" / "meta.json").read_text())
        assert staged["metrics"] is not None and staged["step"] == 10
        assert json.loads((clone / "metrics.json").read_text())["step"] == 10
        receipts = list((clone / "hub_receipts").glob("you--model-*.json"))
        assert len(receipts) == 1 and json.loads(receipts[0].read_text())["verified"] is True
    # docs/stage.md's block, in the same folder: a stage without metrics.
    (tmp_path / "stage_doc.py").write_text("\n".join(python_blocks(REPO / "docs" / "stage.md")))
    result = run_python([tmp_path / "stage_doc.py"], cwd=clone, env=script_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((clone / "hub_stage" / "meta.json").read_text())["metrics"] is None


SCRIPTS = sorted(path.name for path in (REPO / "scripts").glob("[0-9][0-9]_*.py")) + ["demo.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_run_by_a_python_without_the_project_says_how_to_get_it_in_one_line(script, tmp_path):
    """A Python without site-packages (-S) stands for the system's Python: it imports neither
    the project nor its libraries. With the project on PYTHONPATH, a library is what is missing."""
    bare = {k: v for k, v in script_env().items() if k != "PYTHONPATH"}
    for env, missing in (
        (bare, "localhub" if script == "demo.py" else "pipeline"),
        ({**bare, "PYTHONPATH": str(REPO)}, None),
    ):
        result = subprocess.run(
            [sys.executable, "-S", str(REPO / "scripts" / script), "--help"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        line = one_line_error(result)
        assert result.returncode == 2 and result.stdout == ""
        assert f"this Python ({sys.executable}) cannot import " in line
        assert missing is None or f"cannot import {missing}," in line, line
        assert "bin/activate" in line and f"bin/python {REPO / 'scripts' / script}" in line, line


def _demo_module(monkeypatch):
    spec = importlib.util.spec_from_file_location("demo_script", REPO / "scripts" / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "demo_script", demo)  # its dataclasses look their module up
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # as running it does: its folder first on the path
    spec.loader.exec_module(demo)
    return demo


def test_the_demo_writes_every_output_in_a_folder_of_its_own(monkeypatch, tmp_path):
    """After make demo, the README's commands on config.yaml start afresh: none of the demo's
    steps writes where config.yaml's run does (its data, checkpoints, metrics, stage,
    proof or receipts)."""
    demo = _demo_module(monkeypatch)
    monkeypatch.chdir(REPO)
    readme_run, config = load_config("config.yaml"), demo.demo_config()
    keys = ["data.dir", *derived_outputs(None)]
    for key in keys:
        mine, theirs = config.flat()[key], readme_run.flat()[key]
        assert Path(mine).is_relative_to(demo.OUTPUTS) and not Path(theirs).is_relative_to(demo.OUTPUTS), key
    steps = [*demo._steps("demo/x"), demo._publish_step("demo/x", "http://127.0.0.1:9")]
    for step in steps:
        args = list(step.args)
        sets = dict(args[i + 1].split("=", 1) for i, arg in enumerate(args) if arg == "--set")
        if step.script != "06_publish.py":
            assert load_config("config.yaml", sets).flat() == config.flat(), step.script
        for flag in ("--output", "--stage", "--receipt-dir"):
            if flag in args:
                assert Path(args[args.index(flag) + 1]).is_relative_to(demo.OUTPUTS), (step.script, flag)
    assert demo._publish_step("demo/x", "u").args[-3] == config.outputs.stage


def test_the_demo_checks_its_local_hub_first_and_names_why_it_cannot_start(tmp_path, monkeypatch, capsys):
    demo = _demo_module(monkeypatch)
    monkeypatch.setattr(demo, "HUB_ROOT", tmp_path / "hub")
    with LocalHub(tmp_path / "hub", token="t"):  # another server holds that state folder
        with pytest.raises(demo.DemoFailed):
            demo._start_hub("secret")
    said = capsys.readouterr().err
    assert "demo: the local Hub did not start: " in said and "another localhub is already serving" in said
    hub = demo._start_hub("secret")  # free again: it starts
    try:
        assert hub.url.startswith("http://127.0.0.1:")
    finally:
        hub.stop()
