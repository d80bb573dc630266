"""Crash consistency of every commit protocol, by enumeration instead of sampling.

A SIGKILL at a random instant rarely lands in the microsecond windows that matter, and the
page cache survives it anyway. So:

- ``test_every_crash_point_...`` runs each protocol (checkpoint save and prune for
  ``keep_last`` 1 and 2, data preparation, the stage swap, the receipt) in a real process
  (tests/helpers/crash_child.py) that records its file-system calls and checks their order, then
  fails it right before each call in turn, by ``os._exit`` and by an injected ``OSError``,
  and checks the recovery invariants before and after the next start;
- ``test_power_cut_...`` replays a checkpoint save against a model of the page cache that
  loses everything not fsynced (tests/helpers/oprecorder.py, ``PageCache``) and checks that what
  survives each crash point recovers to the previous or the new checkpoint.

The real code runs unchanged: the calls are intercepted from the test side.
"""

from __future__ import annotations

import json

import pytest
from crash_child import META, CheckpointSave, _tensors
from oprecorder import Op, PageCache, Recorder, ordering_problems

from support import HELPERS, run_python, script_env

PROTOCOLS = {
    "checkpoint-keep1": ("rename", "rmtree"),
    "checkpoint-keep2": ("rename", "rmtree"),
    "checkpoint-keep2-noprune": ("rename",),
    "data": ("rename",),
    "receipt": ("rename",),
    "stage": ("rename", "rmtree"),
}


@pytest.mark.heavy
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_every_crash_point_of_every_commit_protocol_recovers(protocol, request, tmp_path):
    # Only the stage swap needs a trained, evaluated and staged run (a session fixture).
    source = [str(request.getfixturevalue("staged_run").root)] if protocol == "stage" else []
    result = run_python(
        [HELPERS / "crash_child.py", protocol, str(tmp_path / "work"), *source],
        cwd=tmp_path,
        env=script_env(),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    kinds = [report["ops"][index].split()[0] for index in report["crashed_at"]]
    # Enough points to mean something: the process was failed at every kind of call the protocol must make.
    assert {"create", "fsync", "fsync(dir)", *PROTOCOLS[protocol]} <= set(kinds), report["ops"]
    assert report["problems"] == [], "\n".join(report["problems"][:20])


def test_the_ordering_check_names_each_missing_fsync_and_an_early_deletion():
    good = [
        Op("mkdir", "/r/.tmp-a"),
        Op("create", "/r/.tmp-a/f"),
        Op("fsync", "/r/.tmp-a/f"),
        Op("fsync", "/r/.tmp-a", is_dir=True),
        Op("rename", "/r/.tmp-a", "/r/a"),
        Op("fsync", "/r", is_dir=True),
        Op("rename", "/r/old", "/r/.deleting-old"),
        Op("rmtree", "/r/.deleting-old", is_dir=True),
    ]
    assert ordering_problems(good) == []
    without = {
        2: "without an fsync after it was written",
        3: "before the folder itself was fsynced",
        5: "never fsynced after rename",
    }
    for index, message in without.items():
        assert any(message in p for p in ordering_problems(good[:index] + good[index + 1 :])), index
    early = good[:4] + good[6:7] + good[4:6] + good[7:]
    assert any("removes what existed before the commit" in p for p in ordering_problems(early))


# -- simulated power loss ------------------------------------------------------------------------


@pytest.mark.parametrize("keep_last,before", [(1, [1]), (2, [1, 2]), (2, [1])])
def test_power_cut_at_any_point_of_a_save_leaves_the_previous_or_the_new_checkpoint(
    tmp_path, keep_last, before
):
    protocol = CheckpointSave(keep_last, before)
    live = tmp_path / "live"
    live.mkdir()
    protocol.setup(live)
    cache = PageCache(live / "estados_local")
    states = [cache.durable()]

    def after(op: Op) -> None:
        cache.after(op)
        states.append(cache.durable())

    with protocol._store(live) as store:
        with Recorder(live / "estados_local", after=after) as recorder:
            store.save(protocol.new, *_tensors(protocol.new), META)
    assert len(states) == len(recorder.ops) + 1 and any(op.kind == "rename" for op in recorder.ops)
    for point, state in enumerate(states):
        base = tmp_path / f"cut-{point}"
        (base / "estados_local").mkdir(parents=True)
        cache.materialize(state, base / "estados_local")
        protocol.recover(base)
        where = f"power cut after {point} of {len(recorder.ops)} calls ({recorder.ops[point - 1] if point else 'none'})"
        assert protocol.check(base, recovered=True) == [], where
        if point == len(states) - 1:  # save() returned: the new checkpoint must survive
            assert protocol.new in protocol._store(base).committed_steps(), (
                f"{where}: the returned save was lost"
            )
