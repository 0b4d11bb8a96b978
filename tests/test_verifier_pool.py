"""The Verifier's worker pool: ordering, futures, soft and hard time limits, crashes, start-up failure, close."""

import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import as_completed

import pytest

from asyncrl.envs.math_file import MathFileTask
from asyncrl.tasks import Sample, Score, Task, Verifier, VerifierConfig
from asyncrl.tasks.extract import AnswerLimits

# Pre-filters off, so hostile answers reach sympy and only the time limits stand in the way.
PERMISSIVE = AnswerLimits(max_chars=10_000, max_depth=1_000, max_exponent_digits=1_000, max_factorial_digits=1_000)


class CrashingTask(Task):
    """Misbehaves on cue: 'crash' kills its worker, 'hang' blocks in C, 'raise' raises. Defined here; the worker
    imports this module to unpickle it."""

    label = "crash"

    def samples(self, split, seed):
        yield from ()

    def score(self, completion, sample):
        if completion == "crash":
            os._exit(3)
        if completion == "hang":
            sum(range(10**13))  # one C loop that never checks for signals, so the soft alarm cannot stop it
        if completion == "raise":
            raise RuntimeError("scorer bug")
        return Score(1.0 if completion == sample.answer else 0.0, "correct" if completion == sample.answer else "wrong")


class BrokenWarmupTask(CrashingTask):
    def warmup(self):
        raise ImportError("missing dependency for this task")


@pytest.fixture(scope="module")
def math_task(tmp_path_factory):
    path = tmp_path_factory.mktemp("pool") / "m.jsonl"
    with open(path, "w") as f:
        for i in range(4):
            row = {"problem": f"half of {i}", "answer": f"\\frac{{{i}}}{{2}}", "unique_id": str(i)}
            f.write(json.dumps(row) + "\n")
    return MathFileTask(str(path), schema="math500", limits=PERMISSIVE)


def _sample(gold: str, i: int = 0) -> Sample:
    return Sample(f"s{i}", "p", gold, {"task": "math500"})


def test_pool_matches_inline_and_keeps_order(math_task):
    items = []
    for i in range(40):
        gold = rf"\frac{{{i}}}{{2}}"
        pred = str(i / 2) if i % 3 else str(i / 2 + 1)
        items.append((rf"<think>\boxed{{0}}</think> so \boxed{{{pred}}}" if i % 5 else "no idea", _sample(gold, i)))
    inline = Verifier(math_task, VerifierConfig(workers=0)).score_batch(items)
    with Verifier(math_task, VerifierConfig(workers=2, timeout_s=5.0)) as v:
        pooled = v.score_batch(items)
        futures = [v.submit(c, s) for c, s in items[:8]]
        done = {f.result(timeout=30) for f in as_completed(futures, timeout=30)}
    assert pooled == inline
    assert {s.reason for s in pooled} == {"correct", "wrong", "no_answer"}
    assert [s.reason == "correct" for s in pooled] == [bool(i % 3) and bool(i % 5) for i in range(40)]
    assert done <= set(pooled)


def test_hard_limit_kills_a_stuck_worker_and_the_pool_recovers(caplog):
    """The hard limit fires: the stuck answer scores 'timeout', the warning names its sample and the limit, and the
    worker is replaced (how soon is a benchmark's business, not a unit test's)."""
    timeout_s = 1.5
    with Verifier(CrashingTask(), VerifierConfig(workers=1, timeout_s=timeout_s)) as v:
        assert v.score_batch([("a", _sample("a"))])[0].reason == "correct"
        with caplog.at_level(logging.WARNING, logger="asyncrl.tasks.verifier"):
            stuck = v.submit("hang", _sample("a", 7))
            queued = v.submit("a", _sample("a"))
            assert stuck.result(timeout=30) == Score(0.0, "timeout")
        assert any("answer to s7 exceeded 1.5s; killing worker pid" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
        assert v.stats["restarts"] == 1 and v.stats["timeouts"] == 1
        # The answer queued behind the stuck one is graded by the replacement worker.
        assert queued.result(timeout=30).reason == "correct"


def test_soft_limit_stops_sympy_bignum_work_without_a_restart(math_task):
    # A 10^9-digit power: CPython's bignum pow checks for signals, so the in-worker alarm (80% of timeout_s)
    # stops it and the worker survives.
    with Verifier(math_task, VerifierConfig(workers=1, timeout_s=1.5)) as v:
        score = v.submit(r"\boxed{99999999999^{99999999}}", _sample("3")).result(timeout=30)
        assert score == Score(0.0, "timeout")
        assert v.stats["restarts"] == 0
        assert v.score_batch([(r"\boxed{3}", _sample("3"))])[0].reason == "correct"


def test_crash_and_exception_in_scorer_cost_one_answer_only():
    task = CrashingTask()
    with Verifier(task, VerifierConfig(workers=1, timeout_s=5.0)) as v:
        scores = v.score_batch([(c, _sample("a")) for c in ("a", "crash", "raise", "a")])
        assert [s.reason for s in scores] == ["correct", "error", "error", "correct"]
        assert v.stats["restarts"] == 1


def test_workers_that_cannot_start_fail_futures_instead_of_hanging():
    v = Verifier(BrokenWarmupTask(), VerifierConfig(workers=1, timeout_s=1.0))
    try:
        future = v.submit("a", _sample("a"))
        with pytest.raises(RuntimeError, match="failed to start.*missing dependency"):
            future.result(timeout=60)
        with pytest.raises(RuntimeError, match="verifier stopped.*failed to start"):
            v.submit("a", _sample("a"))
    finally:
        v.close()


def test_close_is_idempotent_and_rejects_new_work(math_task):
    v = Verifier(math_task, VerifierConfig(workers=1))
    v.close()
    v.close()
    with pytest.raises(RuntimeError, match="after close"):
        v.submit("x", _sample("1"))


def test_workers_die_with_a_crashed_parent(tmp_path):
    # A parent that dies without close() while its worker is stuck in C must not leave the worker spinning.
    pid_file, log = tmp_path / "worker.pid", tmp_path / "parent.log"
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, time\n"
        f"from {CrashingTask.__module__} import CrashingTask, _sample\n"
        "from asyncrl.tasks import Verifier, VerifierConfig\n"
        "v = Verifier(CrashingTask(), VerifierConfig(workers=1, timeout_s=600))\n"
        "v.score_batch([('a', _sample('a'))])\n"
        "v.submit('hang', _sample('a'))\n"
        "time.sleep(0.5)\n"
        f"open({str(pid_file)!r}, 'w').write(str(v._workers[0].proc.pid))\n"
        "os._exit(0)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with open(log, "w") as out:  # a file, not a pipe: a surviving worker would hold a pipe open
        subprocess.run([sys.executable, str(script)], env=env, stdout=out, stderr=out, timeout=60)
    assert pid_file.exists(), log.read_text()[-2000:]
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, 9)
        pytest.fail(f"worker {pid} outlived its parent")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_pending_answers_are_bounded_and_a_blocked_submit_names_the_pool():
    """With its one worker stuck on a 'hang' answer, the pool holds max_pending answers; one more submit waits
    submit_timeout_s and fails with a message instead of queueing without bound."""
    cfg = VerifierConfig(workers=1, timeout_s=30.0, max_pending=2, submit_timeout_s=0.5)
    with Verifier(CrashingTask(), cfg) as v:
        first = v.submit("hang", _sample("x"))
        deadline = time.time() + 60
        while not first.running() and time.time() < deadline:  # the worker has taken it
            time.sleep(0.05)
        assert first.running()
        queued = [v.submit("a", _sample("a", i)) for i in range(2)]  # fills max_pending
        t0 = time.time()
        with pytest.raises(TimeoutError, match=r"2 answers pending \(task.verifier.max_pending=2\) for 0.5s; the 1 "
                                               r"grading workers are not keeping up or are stuck"):
            v.submit("a", _sample("a", 9))
        assert 0.4 < time.time() - t0 < 10
        assert not any(f.done() for f in queued)
