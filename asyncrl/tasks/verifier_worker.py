"""The worker process of the Verifier's pool (`verifier.py` says why processes): receive the pickled task, warm up,
then grade one answer at a time in the main thread, under a SIGALRM soft limit and an address-space cap, dying
with the dispatcher thread that started it.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from asyncrl.tasks.base import Sample, Score, Task

logger = logging.getLogger("asyncrl.tasks.verifier")


class _SoftTimeout(BaseException):
    """BaseException so that libraries' `except Exception` cannot swallow it."""


def _on_alarm(signum: int, frame: object) -> None:
    raise _SoftTimeout()


def _score_guarded(task: Task, completion: str, sample: Sample, soft_s: float) -> Score:
    try:
        signal.setitimer(signal.ITIMER_REAL, soft_s)
        try:
            return task.score(completion, sample)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _SoftTimeout:
        return Score(0.0, "timeout")
    except Exception:  # noqa: BLE001 - a grading bug must cost one answer, not the run
        logger.warning("grading raised for sample %s:\n%s", sample.id, traceback.format_exc(limit=5))
        return Score(0.0, "error")


def _cap_address_space(headroom_mb: int) -> None:
    """Let the worker grow by `headroom_mb` beyond its post-warm-up size; past that, allocations raise MemoryError
    (a bignum bomb then fails inside the worker instead of swapping the machine)."""
    import resource

    current = 0
    try:
        with open("/proc/self/status") as f:
            current = next((int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:")), 0)
    except OSError:
        pass
    limit = current + (headroom_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL us when the dispatcher thread that started us goes away (Linux). A worker stuck in
    C code never reads its pipe, so it would not notice the EOF of a crashed trainer and would spin on forever."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        os._exit(1)


def worker_entry(read_fd: int, write_fd: int, parent_pid: int) -> None:
    """Main of a worker process: receive the task, warm up, then grade one answer at a time forever."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    inbox = Connection(read_fd, writable=False)
    outbox = Connection(write_fd, readable=False)
    try:
        payload, soft_s, memory_limit_mb = inbox.recv()
        task: Task = pickle.loads(payload)
        task.warmup()
        if memory_limit_mb:
            _cap_address_space(memory_limit_mb)
    except BaseException:
        outbox.send(("init_error", traceback.format_exc()))
        return
    signal.signal(signal.SIGALRM, _on_alarm)
    outbox.send(("ready", os.getpid()))
    while True:
        try:
            msg = inbox.recv()
        except EOFError:
            return
        if msg is None:
            return
        job_id, completion, sample = msg
        outbox.send((job_id, _score_guarded(task, completion, sample, soft_s)))
