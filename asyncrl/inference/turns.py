"""The driver of the engine's episodes: a finished decode row made a model turn of its episode (`collect`), each
environment step on a worker thread, its answer taken back on the decode thread (`poll`), and the continuations
launched back into the decode batch ahead of new prompts (`launch_ready`): fed by decode steps from their parked
caches when short, through `extend` from them when longer, or, for a cache the park store had no room for, through a
prefill of the whole history."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.episodes import Continuation, Episode, Fed, Group, Queued, Stepping, Target
from asyncrl.inference.parking import ParkStore
from asyncrl.inference.scheduler import Scheduler
from asyncrl.inference.state import FinishedRow
from asyncrl.inference.stats import EngineStats
from asyncrl.models.tokenizer import Tokenizer
from asyncrl.rollout import AsyncEnvironment, Rollout, StepResult, Turn

log = logging.getLogger(__name__)


class EpisodeDriver:
    """The episodes of one replica: queues their next turns on `scheduler` and keeps their caches in `store` (None:
    a single-turn replica, whose episodes end at their first turn). `emit` receives each finished group."""

    def __init__(self, cfg: InferenceConfig, name: str, stats: EngineStats, scheduler: Scheduler,
                 store: ParkStore | None, tokenizer: Tokenizer | None, eos_id: int, stop: Sequence[tuple[int, ...]]):
        self.cfg, self.name, self.stats, self.scheduler, self.store = cfg, name, stats, scheduler, store
        self.tokenizer, self.eos_id, self.stop = tokenizer, eos_id, stop
        self.S, self.P, self.B = cfg.max_seq_len, cfg.max_prefill_prompts, cfg.max_decode_batch_size
        self.stepping: list[Stepping] = []  # episodes whose environment is stepping
        self.ready: list[Continuation] = []  # episodes whose next turn can go back into the decode batch
        self.emit: Callable[[Rollout], Any] | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def busy(self) -> bool:
        return bool(self.stepping or self.ready)

    # ---- a model turn ---------------------------------------------------------------------------------------

    def parks(self, target: Target) -> bool:
        """Whether the row of `target` that just finished its turn keeps its cache in the park store while its
        environment steps: not when no turn can follow this one."""
        ep = target.episode
        return self.store is not None and ep.env is not None and ep.turn + 1 < self.cfg.max_turns

    def collect(self, r: FinishedRow, target: Target, park: int) -> None:
        """A finished row (on the host already, `park` the park row its cache went to or -1): a model turn of its
        episode, handed to the episode's environment (or, with none, the end of it)."""
        t0 = time.perf_counter()
        ep = target.episode
        pl, n = int(r.prompt_len), int(r.length)
        toks = np.asarray(r.tokens[pl:n], np.int32)
        text = self.tokenizer.decode(toks[:-1] if len(toks) and toks[-1] == self.eos_id else toks) \
            if self.tokenizer else ""
        finish = "length" if bool(r.hit_length) else ("stop" if self._ends_with_stop(toks) else "eos")
        ep.add_turn(toks, np.asarray(r.logprobs[pl:n], np.float32), np.asarray(r.forced[pl:n], bool),
                    np.asarray(r.versions[pl:n], np.int32), text, finish, bool(r.end_of_think),
                    context_versions=r.versions[:pl], routes=None if r.routes is None else r.routes[pl:n])
        self.stats.finished += 1
        self.stats.generated_tokens += len(toks)
        if ep.env is None:
            self._release(park)
            ep.end(None)
            self._maybe_emit(target.group)
        else:
            last = ep.turn >= self.cfg.max_turns or n >= self.S - 1
            part = ep.parts[-1]
            turn = Turn(toks, text, ep.turn - 1, finish, last, part.logprobs, part.forced, part.versions)
            self.stepping.append(Stepping(self._step(ep, turn), target, park, last))
        self.stats.detokenize_time += time.perf_counter() - t0
        self.poll()

    def _ends_with_stop(self, toks: np.ndarray) -> bool:
        return any(len(toks) >= len(q) and tuple(toks[-len(q):]) == q for q in self.stop)

    # ---- environment steps ----------------------------------------------------------------------------------

    def _step(self, ep: Episode, turn: Turn) -> Future:
        """The environment's step, on a worker thread (an `AsyncEnvironment`'s on its own time, holding none); it
        records its own duration."""
        if isinstance(ep.env, AsyncEnvironment):
            try:  # its failure ends the episode ('env_error'), as a synchronous step's does, not the decode loop
                return _timed(time.perf_counter(), ep.env.step_async(turn))
            except Exception as e:  # noqa: BLE001 - handed to the episode through the future
                failed: Future = Future()
                failed.set_exception(e)
                return failed
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.cfg.env_threads, thread_name_prefix=f"{self.name}-env")

        def timed() -> tuple[StepResult, float]:
            t0 = time.perf_counter()
            res = ep.env.step(turn)  # type: ignore[union-attr]
            return res, time.perf_counter() - t0

        return self._pool.submit(timed)

    def poll(self) -> None:
        """Take the environments' answers that have come: end an episode, or ready its next turn."""
        still = []
        for s in self.stepping:
            if not s.future.done():
                still.append(s)
                continue
            group, k, ep = s.target.group, s.target.k, s.target.episode
            self.stats.env_steps += 1
            try:
                res, dt = s.future.result()
                ep.env_s += dt
                self.stats.env_time += dt
            except Exception as e:  # noqa: BLE001 - an environment's failure ends its episode, never the run
                log.warning("%s: the environment of %s (sample %d) failed at turn %d: %r", self.name,
                            group.rollout.prompt.id, k, ep.turn - 1, e)
                res = StepResult(None, 0.0, True, reason="env_error", info={"error": repr(e)})
            if res.info:
                ep.env_info.append(res.info)
            end = self._end_reason(ep, res, s.last)
            if end is None:
                feed = np.concatenate([ep.parts[-1].tokens[-1:], np.asarray(res.observation, np.int32)])
                self.ready.append(Continuation(group, k, feed, s.park))
            else:
                self._release(s.park)
                ep.end(res, end)
                self._maybe_emit(group)
        self.stepping = still

    def _end_reason(self, ep: Episode, res: StepResult, last: bool) -> str | None:
        """None to go on; else why the episode ends."""
        if res.done:
            return "done" if res.reason != "env_error" else "env_error"
        if last:
            return "max_turns" if ep.turn >= self.cfg.max_turns else "context"
        obs = res.observation
        if obs is None or len(obs) == 0:
            return "env_error"  # a step that continues must say something
        cap = self.cfg.max_observation_tokens
        if cap is not None and len(obs) > cap:
            return "obs_cap"
        if ep.length + len(obs) + 1 >= self.S:  # the observation and at least one sampled token must fit
            return "context"
        return None

    def _release(self, park: int) -> None:
        if self.store is not None:
            self.store.release(park)

    def _maybe_emit(self, group: Group) -> None:
        if group.done and self.emit is not None:
            self.emit(group.finish())

    # ---- continuations --------------------------------------------------------------------------------------

    def launch_ready(self) -> None:
        """Continuations back into the decode batch, ahead of new prompts. One of at most
        `inference.decode_feed_tokens` tokens with a parked cache is queued as it is: the decode call that puts it
        in a free slot takes its cache from the park store, and the steps feed its tokens (no extra program, no
        wait). Others go up to P at a time through `extend`
        from their parked caches, or, for a cache the park store had no room for, a prefill of the history.
        An extend reads every weight once, as a decode step does, whatever its rows: while other work keeps the
        decode batch full (queued rows, no free slot), continuations wait up to `inference.extend_wait_s` to be
        extended P at a time rather than one by one (measured: 2.5 rows a call cost 21% of a replica's time).
        The wait is per batch: after a full batch of P goes, the rest wait again (their own time) unless a slot would
        idle; flushing them with it made a third of the extends one-row calls when continuations came in bursts.
        Waiting rows hold their park rows, so nothing waits while fewer than P park rows are free: a turn that ends
        meanwhile must find room, or its episode goes on by a prefill of its whole history."""
        short = [c.park >= 0 and len(c.feed) <= self.cfg.decode_feed_tokens for c in self.ready]
        fed = [c for c, s in zip(self.ready, short) if s]
        if fed:
            self.ready = [c for c, s in zip(self.ready, short) if not s]
            for c in fed:
                c.target.episode.add_observation(c.feed[1:])
            self.scheduler.queue.extendleft(reversed([Queued(Fed(c.park, c.feed), -1, c.target) for c in fed]))
        while self.ready:
            free = len(self.store.free) if self.store is not None else 0
            if len(self.ready) < self.P and (self.scheduler.queue or self.scheduler.in_flight >= self.B) \
                    and free >= self.P \
                    and time.monotonic() - self.ready[0].ready_at < self.cfg.extend_wait_s:
                return
            batch, self.ready = self.ready[: self.P], self.ready[self.P :]
            params, version = self.scheduler.weights.snapshot()
            parked = [c for c in batch if c.park >= 0]
            entries = []
            if parked:
                t0 = time.perf_counter()
                state = self.store.extend(params, version, [c.park for c in parked], [c.feed for c in parked])
                jax.block_until_ready(state.kv)
                self.stats.extend_time += time.perf_counter() - t0
                self.stats.extend_calls += 1
                self.stats.extend_rows += len(parked)
                for i, c in enumerate(parked):
                    c.target.episode.add_observation(c.feed[1:])
                    self._release(c.park)
                    entries.append(Queued(state, i, c.target))
            rest = [c for c in batch if c.park < 0]
            if rest:
                self.stats.parked_full += len(rest)
                for c in rest:
                    c.target.episode.add_observation(c.feed[1:])
                state = self.scheduler.prefill([c.target.episode.history(c.group.rollout.prompt_tokens) for c in rest])
                entries += [Queued(state, i, c.target) for i, c in enumerate(rest)]
            self.scheduler.queue.extendleft(reversed(entries))


def _timed(t0: float, step: Future) -> Future:
    """`step`'s result with the seconds since `t0`, as the pool's steps give it."""
    out: Future = Future()

    def done(f: Future) -> None:
        if f.cancelled():
            out.set_exception(RuntimeError("the environment's step was cancelled"))
            return
        e = f.exception()
        if e is not None:
            out.set_exception(e)
        else:
            out.set_result((f.result(), time.perf_counter() - t0))

    if not isinstance(step, Future):  # e.g. an `async def step_async`: a coroutine is not a concurrent Future
        getattr(step, "close", lambda: None)()  # a coroutine closed, not left to warn that it was never awaited
        raise TypeError(f"step_async returned {type(step).__name__}, not a concurrent.futures.Future")
    step.add_done_callback(done)
    return out
