"""Grade completions off the trainer's critical path, in a bounded pool of worker processes.

Why processes, and why these: math-verify and sympy can spin for minutes on a hostile answer, in C code that no
Python-level timeout interrupts, and math-verify's own timeouts use signals that only work in a main thread.
So each answer is graded in the main thread of a worker process: a SIGALRM there (the soft limit, 80% of
`timeout_s`) stops pure-Python runaways cheaply, and a dispatcher thread here SIGKILLs a worker still busy at
`timeout_s` (the hard limit) and starts a replacement. Either way the answer scores 0 with reason 'timeout'.

Workers are fresh interpreters (`python -c`, talking over inherited pipes), not `fork`s: forking a process that
already runs JAX or Ray threads is unsafe, and unlike multiprocessing's `spawn` this never re-imports the
parent's `__main__`. The task is pickled to each worker once; only `Task.score` runs there (the worker's side
is `verifier_worker.py`).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from asyncrl.tasks.base import Sample, Score, Task
from asyncrl.tasks.config import VerifierConfig

logger = logging.getLogger(__name__)

SOFT_FRACTION = 0.8
START_TIMEOUT_S = 120.0  # a worker must import and warm up within this, or it counts as failed to start
MAX_START_FAILURES = 3  # consecutive failed starts before the pool gives up and fails every pending answer


@dataclass
class _Job:
    id: int
    completion: str
    sample: Sample
    future: Future


@dataclass
class _Worker:
    proc: subprocess.Popen
    inbox: Connection  # parent -> worker
    outbox: Connection  # worker -> parent
    started: float
    ready: bool = False
    job: _Job | None = None
    deadline: float = math.inf


class Verifier:
    """Grades (completion, sample) pairs with `task.score` in `cfg.workers` processes, each answer under a hard
    time limit of `cfg.timeout_s`. Thread-safe; `submit` never blocks on grading.

    `cfg.workers == 0` grades inline in the caller with no time limit (tests, debugging).
    """

    def __init__(self, task: Task, cfg: VerifierConfig = VerifierConfig()) -> None:
        self.task = task
        self.cfg = cfg
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when a pending answer leaves for a worker
        self._pending: deque[_Job] = deque()
        self._ids = itertools.count()
        self._closed = False
        self._fatal: BaseException | None = None
        self.stats = {"graded": 0, "timeouts": 0, "errors": 0, "restarts": 0}
        if cfg.workers == 0:
            return
        self._payload = pickle.dumps(task)
        wake_r, wake_w = os.pipe()
        self._wake_r, self._wake_w = Connection(wake_r, writable=False), Connection(wake_w, readable=False)
        self._wake_pending = False
        self._start_failures = 0
        # Filled by the dispatcher thread: workers die with the thread that started them (see _die_with_parent),
        # and the dispatcher lives exactly as long as the pool.
        self._workers: list[_Worker] = []
        self._thread = threading.Thread(target=self._run, name="verifier-dispatch", daemon=True)
        self._thread.start()

    # -- public API --

    def submit(self, completion: str, sample: Sample, timeout: float | None = None) -> Future[Score]:
        """Queue one answer; the future resolves to its Score (never raises for a bad answer). With the pool full
        (`max_pending` answers queued), wait up to `timeout` (default `task.verifier.submit_timeout_s`) for room,
        then raise TimeoutError."""
        wait_s = self.cfg.submit_timeout_s if timeout is None else timeout
        future: Future = Future()
        if self.cfg.workers == 0:
            future.set_running_or_notify_cancel()
            future.set_result(self._score_inline(completion, sample))
            return future
        with self._lock:
            if not self._room.wait_for(lambda: len(self._pending) < self.cfg.max_pending or self._closed
                                       or self._fatal is not None, timeout=wait_s):
                raise TimeoutError(f"Verifier: {len(self._pending)} answers pending (task.verifier.max_pending="
                                   f"{self.cfg.max_pending}) for {wait_s:g}s; the {self.cfg.workers} "
                                   "grading workers are not keeping up or are stuck")
            if self._closed:
                raise RuntimeError("Verifier.submit after close()")
            if self._fatal is not None:
                raise RuntimeError(f"verifier stopped, no answer can be graded: {self._fatal}")
            self._pending.append(_Job(next(self._ids), completion, sample, future))
            if not self._wake_pending:
                self._wake_pending = True
                self._wake_w.send_bytes(b"!")
        return future

    def score_batch(self, items: Sequence[tuple[str, Sample]], timeout: float | None = None) -> list[Score]:
        """Grade every (completion, sample) pair; results are in input order.

        `timeout` bounds the whole wait; by default it is generous enough that every answer could hit the hard
        limit and need a fresh worker, so reaching it means the pool itself is broken.
        """
        futures = [self.submit(c, s) for c, s in items]
        if timeout is None:
            per_slot = self.cfg.timeout_s + 10.0
            timeout = START_TIMEOUT_S + per_slot * math.ceil(len(items) / max(1, self.cfg.workers))
        end = time.monotonic() + timeout
        out = []
        for i, f in enumerate(futures):
            try:
                out.append(f.result(timeout=max(0.0, end - time.monotonic())))
            except TimeoutError as e:
                raise TimeoutError(
                    f"Verifier: answer {i} of {len(items)} not graded within {timeout:.0f}s "
                    f"(workers={self.cfg.workers}, timeout_s={self.cfg.timeout_s})") from e
        return out

    def close(self) -> None:
        """Stop the workers; answers not yet graded get a RuntimeError. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._room.notify_all()
        if self.cfg.workers == 0:
            return
        self._wake()
        self._thread.join(timeout=10.0)
        for w in self._workers:
            self._stop_worker(w, graceful=True)
        err = RuntimeError("Verifier closed before this answer was graded")
        for job in list(self._pending) + [w.job for w in self._workers if w.job is not None]:
            if not job.future.done():
                job.future.set_exception(err) if job.future.running() else job.future.cancel()
        self._pending.clear()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inline mode --

    def _score_inline(self, completion: str, sample: Sample) -> Score:
        try:
            score = self.task.score(completion, sample)
        except Exception:  # noqa: BLE001
            logger.warning("grading raised for sample %s:\n%s", sample.id, traceback.format_exc(limit=5))
            score = Score(0.0, "error")
        self._count(score)
        return score

    # -- dispatcher thread --

    def _count(self, score: Score) -> None:
        self.stats["graded"] += 1
        if score.reason == "timeout":
            self.stats["timeouts"] += 1
        elif score.reason == "error":
            self.stats["errors"] += 1

    def _wake(self) -> None:
        with self._lock:
            if self._wake_pending:
                return
            self._wake_pending = True
            self._wake_w.send_bytes(b"!")

    def _spawn(self) -> _Worker:
        p2c_r, p2c_w = os.pipe()
        c2p_r, c2p_w = os.pipe()
        env = dict(os.environ)
        # The worker must import asyncrl from wherever this process did (an editable checkout, a test's cwd).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path + env.get("PYTHONPATH", "").split(os.pathsep) if p)
        code = f"from asyncrl.tasks.verifier_worker import worker_entry; worker_entry({p2c_r}, {c2p_w}, {os.getpid()})"
        try:
            proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(p2c_r, c2p_w), env=env,
                                    stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            # Our copies of the worker's ends must go, so that the worker's death reads as EOF here.
            os.close(p2c_r)
            os.close(c2p_w)
        inbox = Connection(p2c_w, readable=False)
        outbox = Connection(c2p_r, writable=False)
        soft_s = max(0.05, SOFT_FRACTION * self.cfg.timeout_s)
        try:
            inbox.send((self._payload, soft_s, self.cfg.memory_limit_mb))
        except OSError:
            pass  # died at once; the EOF on its outbox is handled like any other death
        return _Worker(proc, inbox, outbox, started=time.monotonic())

    def _stop_worker(self, w: _Worker, graceful: bool) -> None:
        if graceful and w.proc.poll() is None:
            try:
                w.inbox.send(None)
                w.proc.wait(timeout=2.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait(timeout=5.0)
        for conn in (w.inbox, w.outbox):
            conn.close()

    def _resolve(self, job: _Job, score: Score) -> None:
        self._count(score)
        if not job.future.done():
            job.future.set_result(score)

    def _replace(self, i: int, score_for_job: Score, started_ok: bool) -> None:
        w = self._workers[i]
        self._stop_worker(w, graceful=False)
        if w.job is not None:
            self._resolve(w.job, score_for_job)
        self._start_failures = 0 if started_ok else self._start_failures + 1
        self.stats["restarts"] += 1
        if self._start_failures >= MAX_START_FAILURES:
            raise RuntimeError(f"{self._start_failures} verifier workers in a row failed to start; "
                               f"last: {getattr(self, '_last_init_error', 'exited during start-up')}")
        self._workers[i] = self._spawn()

    def _dispatch(self) -> None:
        now = time.monotonic()
        for w in self._workers:
            if not w.ready or w.job is not None:
                continue
            while True:
                with self._lock:
                    job = self._pending.popleft() if self._pending else None
                    self._room.notify_all()
                if job is None or job.future.set_running_or_notify_cancel():
                    break
            if job is None:
                return
            w.job, w.deadline = job, now + self.cfg.timeout_s
            try:
                w.inbox.send((job.id, job.completion, job.sample))
            except OSError:
                pass  # worker died; its EOF is picked up by the wait loop and the job resolved as 'error'

    def _handle_message(self, i: int) -> None:
        w = self._workers[i]
        try:
            msg = w.outbox.recv()
        except (EOFError, OSError):
            self._replace(i, Score(0.0, "error"), started_ok=w.ready)
            return
        if msg[0] == "ready":
            w.ready = True
            self._start_failures = 0
        elif msg[0] == "init_error":
            self._last_init_error = msg[1].strip().splitlines()[-1]
            logger.error("verifier worker failed to start:\n%s", msg[1])
            self._replace(i, Score(0.0, "error"), started_ok=False)
        else:
            job_id, score = msg
            if w.job is not None and w.job.id == job_id:
                job, w.job, w.deadline = w.job, None, math.inf
                self._resolve(job, score)

    def _reap_overdue(self) -> None:
        now = time.monotonic()
        for i, w in enumerate(self._workers):
            if w.job is not None and now >= w.deadline:
                logger.warning("verifier: answer to %s exceeded %.1fs; killing worker pid %d",
                               w.job.sample.id, self.cfg.timeout_s, w.proc.pid)
                self._replace(i, Score(0.0, "timeout"), started_ok=True)
            elif not w.ready and now - w.started > START_TIMEOUT_S:
                self._last_init_error = f"no ready signal within {START_TIMEOUT_S:.0f}s"
                self._replace(i, Score(0.0, "error"), started_ok=False)

    def _run(self) -> None:
        try:
            self._workers.extend(self._spawn() for _ in range(self.cfg.workers))
            while not self._closed:
                self._dispatch()
                now = time.monotonic()
                next_deadline = min([w.deadline for w in self._workers] +
                                    [w.started + START_TIMEOUT_S for w in self._workers if not w.ready])
                timeout = min(max(0.0, next_deadline - now), 1.0)
                conns = {id(w.outbox): i for i, w in enumerate(self._workers)}
                for conn in wait([w.outbox for w in self._workers] + [self._wake_r], timeout):
                    if conn is self._wake_r:
                        with self._lock:
                            while self._wake_r.poll():
                                self._wake_r.recv_bytes()
                            self._wake_pending = False
                    else:
                        self._handle_message(conns[id(conn)])
                self._reap_overdue()
        except BaseException as e:  # noqa: BLE001 - a dead dispatcher must fail futures, not hang them
            logger.exception("verifier dispatcher stopped")
            with self._lock:
                self._fatal = e
                jobs = list(self._pending) + [w.job for w in self._workers if w.job is not None]
                self._pending.clear()
                self._room.notify_all()
            for job in jobs:
                if not job.future.done():
                    if job.future.running() or job.future.set_running_or_notify_cancel():
                        job.future.set_exception(RuntimeError(f"verifier failed: {e}"))
