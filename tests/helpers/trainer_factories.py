"""Tasks for the accumulation/evaluation tests: the regression task without evaluate()."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import Config
from pipeline.tasks.regression import build_data


class _WithoutEvaluate:
    """The regression task's data, every attribute but evaluate."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "evaluate":
            raise AttributeError(name)
        return getattr(self._inner, name)


def build_data_without_evaluate(config: Config, data_dir: Path) -> _WithoutEvaluate:
    return _WithoutEvaluate(build_data(config, data_dir))
