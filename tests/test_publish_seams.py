"""06 at its edges: the receipt lands with the outputs of the config that staged it, and
--timeout takes only a deadline it can keep."""

from __future__ import annotations

import json
import shutil

import pytest

from localhub import LocalHub
from pipeline.errors import PublishError
from pipeline.publishing import Publication, publish

from support import REPO


def test_the_receipt_lands_beside_the_stage_of_the_config_that_staged_it_and_a_rerun_keeps_it(
    staged_run, run_copy, tmp_path
):
    """``--config other.yaml`` stages into runs/other/hub_stage/: 06 writes its receipt to
    runs/other/hub_receipts/, not hub_receipts/ of the working folder (another config's); a
    second publish (make demo's rerun) commits nothing, keeps that receipt and exits 0."""
    run = run_copy(staged_run)
    shutil.copy(REPO / "config.yaml", run.root / "other.yaml")
    outputs = run.root / "runs" / "other"
    shutil.copytree(run.stage, outputs / "hub_stage")

    def publish_other(hub: LocalHub):
        return run.ok("06_publish.py", "--repo-id", "me/other", "--endpoint", hub.url, env={"HF_TOKEN": "t"})

    with LocalHub(tmp_path / "hub", token="t") as hub:
        # RunFolder.script passes the repository's config.yaml: name this folder's own instead.
        first = run.ok(
            "06_publish.py", "--config", "other.yaml", "--repo-id", "me/other", "--endpoint", hub.url,
            env={"HF_TOKEN": "t"},
        )  # fmt: skip
        receipts = sorted((outputs / "hub_receipts").glob("me--other-*.json"))
        assert len(receipts) == 1 and json.loads(receipts[0].read_text())["verified"] is True
        assert f"receipt runs/other/hub_receipts/{receipts[0].name} (written)" in first.stdout, first.stdout
        assert not (run.root / "hub_receipts").exists()
        again = run.ok(
            "06_publish.py", "--config", "other.yaml", "--repo-id", "me/other", "--endpoint", hub.url,
            env={"HF_TOKEN": "t"},
        )  # fmt: skip
        assert "nothing to publish" in again.stdout and "(kept from the publish)" in again.stdout
        assert sorted((outputs / "hub_receipts").glob("*.json")) == receipts
        # The default config's stage: its receipts beside it, in the working folder.
        publish_other(hub)
    assert len(list((run.root / "hub_receipts").glob("me--other-*.json"))) == 1


@pytest.mark.parametrize("value", ["1e308", "inf", "-inf", "nan", "0", "-5", "604801", "1e12"])
def test_a_timeout_that_is_no_deadline_is_refused_in_one_line_before_any_request(value, staged_run, tmp_path):
    with LocalHub(tmp_path / "hub", token="t") as hub:
        line = staged_run.refused("06_publish.py", "--repo-id", "me/x", "--dry-run", "--endpoint", hub.url,
                                  f"--timeout={value}")  # fmt: skip
        assert hub.request_counts() == {}
    assert line.startswith(
        f"error: --timeout {float(value)!r} must be a number of seconds above 0 and at "
    ), line
    assert "at most 604800 (a week)" in line, line


def test_a_week_is_the_longest_timeout_and_a_bool_is_no_timeout(staged_run, tmp_path):
    with LocalHub(tmp_path / "hub", token="t") as hub:
        week = staged_run.ok("06_publish.py", "--repo-id", "me/x", "--dry-run", "--endpoint", hub.url,
                             "--timeout", "604800")  # fmt: skip
        assert "dry run: no write request was sent" in week.stdout
        with pytest.raises(PublishError, match=r"--timeout True must be a number of seconds"):
            publish(
                Publication(
                    repo_id="me/x", stage=staged_run.stage, endpoint=hub.url, dry_run=True, timeout_s=True
                )
            )
