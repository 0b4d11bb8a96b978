"""The decode thread of a served engine: requests come in from the HTTP side, the engine's own continuous batching
samples them (`Engine.generate(..., drain=False)` and `Engine.advance`), and each finished group resolves its
request's future. Admission is bounded: past `max_queued` requests at once, `submit` refuses (the server answers
429) instead of queueing without end.

Standalone, `start()` runs that loop on a thread of its own. In a run the inference worker's replica loop drives the
engine instead (one decode loop, whoever submits): it takes the endpoint's requests with `take` beside its own
prompts, and hands every finished group to `finish`, which keeps the endpoint's."""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

from asyncrl.inference.engine import Engine, Request
from asyncrl.rollout import Rollout

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """More requests than `max_queued` are admitted already."""


class EngineLoop:
    """Owns `engine` on one thread. `submit` is thread-safe; the returned future gets the request's `Rollout`."""

    def __init__(self, engine: Engine, max_queued: int, max_sessions: int = 64):
        self.engine, self.max_queued, self.max_sessions = engine, max_queued, max_sessions
        self._session_ids: set[int] = set()
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._futures: dict[int, tuple[Request, Future]] = {}  # id(prompt) -> its request and future
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def admitted(self) -> int:
        """Plain requests in flight (sessions' episodes apart)."""
        with self._lock:
            return len(self._futures) - len(self._session_ids)

    @property
    def sessions(self) -> int:
        with self._lock:
            return len(self._session_ids)

    def submit(self, request: Request, session: bool = False) -> Future:
        """`session`: the episode of a session's branch, which lives as long as its agent keeps calling (up to
        `endpoint.session_idle_s` idle). Those count against `max_sessions`, apart from `max_queued`: sessions left
        idle can fill their own bound, never hold off plain requests."""
        fut: Future = Future()
        with self._lock:
            if self.error is not None:
                raise RuntimeError(f"the engine loop failed: {self.error!r}")
            if session and len(self._session_ids) >= self.max_sessions:
                raise Overloaded(f"{len(self._session_ids)} session episodes are open (endpoint.max_sessions="
                                 f"{self.max_sessions})")
            if not session and len(self._futures) - len(self._session_ids) >= self.max_queued:
                raise Overloaded(f"{len(self._futures) - len(self._session_ids)} requests are in flight "
                                 f"(endpoint.max_queued={self.max_queued})")
            self._futures[id(request.prompt)] = (request, fut)
            if session:
                self._session_ids.add(id(request.prompt))
        self._inbox.put(request)
        return fut

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"{self.engine.name}-endpoint", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def take(self, wait: bool, limit: int | None = None) -> list[Request]:
        """Up to `limit` (max_prefill_prompts) new requests; waits a moment only when the engine has nothing to do
        (a busy one must not pay a wait per decode call)."""
        limit = self.engine.P if limit is None else limit
        out: list[Request] = []
        try:
            while len(out) < limit:
                out.append(self._inbox.get(timeout=0.05) if wait and not out else self._inbox.get_nowait())
        except queue.Empty:
            pass
        return out

    def finish(self, rollout: Rollout) -> bool:
        """Resolve the future of an endpoint request's group; False if `rollout` is not one (the caller's own)."""
        with self._lock:
            _, fut = self._futures.pop(id(rollout.prompt), (None, None))
            self._session_ids.discard(id(rollout.prompt))
        if fut is None:
            return False
        fut.set_result(rollout)
        return True

    def fail(self, error: BaseException) -> None:
        """The decode loop died: every waiting request learns why, none hangs, and later submits are refused."""
        with self._lock:
            self.error = error
            pending, self._futures = list(self._futures.values()), {}
            self._session_ids.clear()
        for _, fut in pending:
            fut.set_exception(RuntimeError(f"the engine loop failed: {error!r}"))

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                eng.between_loops()
                reqs = self.take(wait=not eng.busy)
                if reqs:
                    eng.generate(reqs, drain=False, on_group=self.finish)
                elif eng.busy:
                    eng.advance(on_group=self.finish)
        except BaseException as e:  # noqa: BLE001 - every waiting request learns why, none hangs
            log.exception("the endpoint's engine loop failed")
            self.fail(e)
