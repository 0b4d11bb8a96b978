"""The run directory's logs after a failure: no torn line is read or appended to, every log is cut back to the
checkpoint a resumed attempt starts from (no step, round or group twice), and no row published before the hosts
die is lost."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from asyncrl.orchestration import evals, jsonl, rollout_log
from asyncrl.orchestration.metrics import MetricsSink


def _lines(path):
    with open(path) as f:
        return f.read().splitlines()


def test_a_torn_last_line_of_metrics_is_dropped_not_fatal_nor_appended_to(tmp_path):
    """A driver killed mid-write leaves half a row; the next attempt's sink must neither crash on it nor glue its
    first row onto it."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "x": 1.0}) + "\n" + json.dumps({"step": 2, "x": 2.0}) + "\n"
                    + '{"step": 3, "x": 3.')  # SIGKILL here
    sink = MetricsSink(str(tmp_path), tensorboard=False, resume_from=2)
    assert [r["step"] for r in sink.rows] == [1, 2]
    sink.write({"step": 3, "x": 3.5})
    assert [json.loads(x)["step"] for x in _lines(path)] == [1, 2, 3]


def test_append_writes_a_batch_in_one_write(tmp_path, monkeypatch):
    writes = []
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, b: (writes.append(len(b)), real(fd, b))[1])
    jsonl.append(str(tmp_path / "r.jsonl"), [{"step": 1, "i": i, "pad": "x" * 1000} for i in range(50)])
    assert len(writes) == 1 and len(_lines(tmp_path / "r.jsonl")) == 50


def test_resume_cuts_rollouts_and_evals_back_to_the_checkpoint(tmp_path):
    """An attempt killed after step 8 had logged steps 1..8 and eval rounds 0, 4, 8; resuming from the checkpoint
    of step 5 relaunches round 8 and redoes steps 6..8, so those go (and the torn tail with them)."""
    d = str(tmp_path)
    for rank_file in ("rollouts.jsonl", "rollouts.rank1.jsonl"):
        jsonl.append(os.path.join(d, rank_file), [{"step": s, "position": s} for s in range(1, 9)])
        with open(os.path.join(d, rank_file), "a") as f:
            f.write('{"step": 9, "posi')
    for name in ("evals.jsonl", "eval_samples.jsonl"):
        jsonl.append(os.path.join(d, name), [{"round": r} for r in (0, 4, 8)])
    rollout_log.truncate(d, 5)
    evals.truncate(d, 5)
    for rank_file in ("rollouts.jsonl", "rollouts.rank1.jsonl"):
        assert [r["step"] for r in jsonl.read(os.path.join(d, rank_file))] == [1, 2, 3, 4, 5]
        assert _lines(os.path.join(d, rank_file))[-1].endswith("}")
    for name in ("evals.jsonl", "eval_samples.jsonl"):
        assert [r["round"] for r in jsonl.read(os.path.join(d, name))] == [0, 4]


def test_write_json_replaces_the_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "hosts.json"
    path.write_text("[]")
    replaced = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((a, b)), real(a, b))[1])
    jsonl.write_json(str(path), [{"rank": 0}])
    assert replaced == [(str(path) + ".tmp", str(path))] and json.loads(path.read_text()) == [{"rank": 0}]


def test_rows_published_before_the_hosts_die_are_kept(monkeypatch):
    """A non-trainer host dies; the trainer, still up, publishes row s and then saves checkpoint s. The driver's
    teardown kills the hosts first and drains the driver queue after, so row s is written before the next attempt
    resumes from checkpoint s."""
    from asyncrl.orchestration import driver

    order = []
    monkeypatch.setattr(driver.ray, "kill", lambda a, no_restart=True: order.append(("kill", a)))
    published = []  # what reached the driver queue: row 7 arrives while the teardown kills the hosts
    queue = SimpleNamespace(drain=lambda: [published.pop(0) for _ in range(len(published))],
                            q=SimpleNamespace(hub="driver-queue"))  # every queue lives in one hub actor
    trainer = "trainer-actor"

    def kill(a, no_restart=True):
        order.append(("kill", a))
        if a == trainer:
            published.append({"step": 7})

    monkeypatch.setattr(driver.ray, "kill", kill)
    written = []
    driver._teardown([trainer], {"driver": queue}, None, [], SimpleNamespace(write=written.append))
    assert written == [{"step": 7}]
    assert order.index(("kill", trainer)) < order.index(("kill", "driver-queue"))
