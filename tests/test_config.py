"""Config errors name the key and the file; overrides win over the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.config import Config, config_from_dict, load_config, parse_set_overrides
from pipeline.errors import ConfigError
from pipeline.factories import resolve

from support import REPO, one_line_error, run_script


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


def test_default_config_file_matches_the_dataclass_defaults_where_it_should():
    config = load_config(REPO / "config.yaml")
    assert config.data.batch_size == 4 and config.data.params["num_train"] == 24
    assert config.training.dtype == "float64" and config.checkpoint.dir == "estados_local"
    # Every key of the file is known (the loader would refuse otherwise) and round-trips.
    assert config_from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "text, expected",
    [
        ("training:\n  max_step: 10\n", r"unknown key training\.max_step"),
        ("trainnig:\n  max_steps: 10\n", r"unknown section 'trainnig'"),
        ("training:\n  max_steps: ten\n", r"training\.max_steps must be int"),
        ("training:\n  max_steps: 0\n", r"training\.max_steps must be >= 1 \(got 0\)"),
        ("training:\n  deterministic: 1\n", r"training\.deterministic must be bool"),
        ("data:\n  batch_size: true\n", r"data\.batch_size must be an integer, got a boolean"),
        ("checkpoint:\n  keep_last: 0\n", r"checkpoint\.keep_last must be >= 1"),
        ("training:\n  device: tpu\n", r"training\.device must be one of"),
        ("optimizer:\n  lr: -1\n", r"optimizer\.lr must be a finite number > 0"),
        ("model:\n  factory: nocolon\n", r"model\.factory must look like"),
        ("- just\n- a list\n", r"top level must be a mapping"),
        ("training: [1, 2\n", r"not valid YAML at line"),
    ],
)
def test_bad_values_name_the_key_and_the_file(tmp_path, text, expected):
    path = write_config(tmp_path, text)
    with pytest.raises(ConfigError, match=expected) as error:
        load_config(path)
    assert str(path) in str(error.value)


def test_ints_are_accepted_where_floats_are_expected(tmp_path):
    config = load_config(write_config(tmp_path, "optimizer:\n  lr: 1\n"))
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)


def test_set_overrides_are_typed_and_win_over_the_file():
    overrides = parse_set_overrides(
        ["training.max_steps=20", "optimizer.lr=1e-3", "checkpoint.async=true", "model.params.hidden=8"]
    )
    config = load_config(REPO / "config.yaml", overrides)
    assert config.training.max_steps == 20 and config.optimizer.lr == 0.001
    assert config.checkpoint.async_ is True and config.model.params["hidden"] == 8
    assert config.model.params["dropout"] == 0.1, "a nested override must keep sibling keys"


def test_malformed_set_override_is_a_config_error():
    with pytest.raises(ConfigError, match="expected SECTION.KEY=VALUE"):
        parse_set_overrides(["max_steps"])


@pytest.mark.parametrize("item", ["training.max_steps=", "training.max_steps= ", "training.max_steps=null"])
def test_a_set_override_with_no_value_is_refused_not_ignored(item):
    """Ignored, a run would train its file's or the default length without a word."""
    with pytest.raises(ConfigError, match=r"no value given: write one after '='"):
        parse_set_overrides([item])
    assert parse_set_overrides(['training.device=""']) == {"training.device": ""}


def test_factory_params_are_validated_by_the_factory(tmp_path):
    from pipeline.run import build_model

    config = load_config(REPO / "config.yaml", {"model.params.hiden": 8})
    with pytest.raises(ConfigError, match=r"unknown key model\.params\.hiden"):
        build_model(config)


def test_unimportable_factory_names_the_key():
    with pytest.raises(ConfigError, match=r"model\.factory: cannot import module 'no_such_module'"):
        resolve("no_such_module:build", "model.factory")
    with pytest.raises(ConfigError, match=r"has no attribute 'nope'"):
        resolve("pipeline.factories:nope", "optimizer.factory")


def test_saved_config_keys_use_yaml_names():
    assert "async" in Config().to_dict()["checkpoint"]
    assert yaml.safe_load(yaml.safe_dump(Config().to_dict())) == Config().to_dict()


def test_script_reports_a_bad_config_in_one_line_with_exit_2(tmp_path):
    path = write_config(tmp_path, "training:\n  max_steps: -3\n")
    result = run_script("02_train.py", "--config", str(path))
    assert result.returncode == 2
    line = one_line_error(result)
    assert "training.max_steps" in line and str(path) in line
