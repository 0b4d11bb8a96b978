"""Agents as environments: `agent.fn: my_pkg.agent:run` names a function `(base_url, api_key, sample) -> reward`
(a number; or the agent's final answer as text, which the task's verifier grades) that talks to the endpoint with
any OpenAI client, as many calls as it likes, concurrently, with tools.

Each sample of a group is one session (`sessions.py`): the agent's calls carry its `session_id` (given to the
function in its sample view, `AgentSample`, and as the default body field of a client made by
`AgentSample.client()`). The function runs on a thread of its own, never the decode thread, at most `agent.workers`
at once within their timeouts. Its return ends the session with that reward; an agent that raises, runs past
`agent.timeout_s`, or never calls the endpoint ends its episode with a reason ("agent_error", "agent_timeout",
"agent_no_call") and the group goes on without it failing the run. Its `agent.timeout_s` counts from the moment the
function starts, not from when it waited for a place among the workers. A timed-out agent's thread cannot be killed:
its session is closed, so its later calls are refused (409), and its thread runs on (counted in `leaked`) but gives
its place back at the timeout, so a hung agent never stalls the episodes after it (a fixed pool would lose a thread to
each), and, a daemon, it never holds up the process's exit."""

from __future__ import annotations

import importlib
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.endpoint.config import AgentConfig
from asyncrl.rollout import Completion, Prompt, Rollout
from asyncrl.validate import ConfigError

log = logging.getLogger(__name__)


def resolve(path: str, field: str = "agent.fn") -> Callable[..., Any]:
    """`module:attr` -> the object. One function, so that the plug-in loader every host shares can replace it."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{field}={path!r} is invalid: must be 'module.path:function'")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{field}={path!r} cannot be imported: {e}") from e
    if not callable(obj):
        raise ConfigError(f"{field}={path!r} is not callable")
    return obj


@dataclass(frozen=True)
class AgentSample:
    """What an agent function receives as its sample: the task's sample and the session its calls belong to."""

    sample: Any
    session_id: str
    base_url: str
    api_key: str

    def client(self, **kw: Any) -> Any:
        """An `openai.OpenAI` client whose every call carries this session."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, **kw).with_options(
            default_headers={"X-Session-Id": self.session_id})


def _empty(reason: str, error: str = "") -> Completion:
    z = np.zeros(0, np.int32)
    return Completion(tokens=z, logprobs=z.astype(np.float32), forced=z.astype(bool), versions=z, reward=0.0,
                      reason=reason, end_reason=reason, env_info=[{"error": error}] if error else [])


class AgentRunner:
    """Runs one agent function over a server's sessions. `run_group(prompt)` samples `prompt.n` episodes."""

    def __init__(self, server: Any, cfg: AgentConfig, fn: Callable[..., Any] | None = None,
                 grade: Callable[[str, Any], float] | None = None):
        """`grade(answer, sample) -> reward`: how an agent's text answer is scored (the task's verifier in a run);
        None: an agent must return a number."""
        self.server, self.cfg, self.grade = server, cfg, grade
        self.fn = fn if fn is not None else resolve(cfg.fn)
        self.places = threading.Semaphore(cfg.workers)  # agents running at once
        self.closed = threading.Event()
        self._hung: set[Future] = set()  # timed-out agents whose threads still run
        self._lock = threading.Lock()

    @property
    def leaked(self) -> int:
        """Agents past their timeout whose threads still run (a thread cannot be killed)."""
        with self._lock:
            return len(self._hung)

    def close(self) -> None:
        """Stop taking agents; waiting ones end unplayed. Running ones cannot be killed: their sessions are closed
        by `_episode` as they time out, and their threads end with them."""
        self.closed.set()

    def _start(self, view: AgentSample) -> Future:
        """The agent on a daemon thread of its own; its future gets the return or the exception."""
        fut: Future = Future()

        def call() -> None:
            try:
                fut.set_result(self.fn(view.base_url, view.api_key, view))
            except BaseException as e:  # noqa: BLE001 - handed to the episode, which ends with its reason
                fut.set_exception(e)
            finally:
                with self._lock:
                    self._hung.discard(fut)

        threading.Thread(target=call, name=f"agent-{view.session_id[-8:]}", daemon=True).start()
        return fut

    def _reward(self, out: Any, sample: Any) -> float:
        if isinstance(out, str):
            if self.grade is None:
                raise TypeError("the agent returned text, and this runner has no verifier to grade it")
            return float(self.grade(out, sample))
        return float(out)

    def _episode(self, prompt: Prompt) -> list[tuple[np.ndarray, Completion]]:
        sid = f"agent-{uuid.uuid4().hex}"
        view = AgentSample(prompt.sample, sid, self.server.url, self.server.cfg.api_key or "none")
        # The runner was closed (the host is stopping): the episode ends, unplayed.
        shut = [(np.zeros(0, np.int32), _empty("agent_error", "the agent pool is shut down"))]
        while not self.places.acquire(timeout=1.0):  # waiting behind other agents: that time is not this agent's
            if self.closed.is_set():
                return shut
        if self.closed.is_set():
            self.places.release()
            return shut
        store = self.server.sessions
        try:
            fut = self._start(view)
            reward, reason, error = self._reward(fut.result(self.cfg.timeout_s), prompt.sample), "done", ""
        except FutureTimeout as e:
            if fut.done() and fut.exception() is e:  # the agent's own TimeoutError (the same class on 3.11+)
                log.warning("agent %s failed on %s: %r", self.cfg.fn, prompt.id, e)
                reward, reason, error = 0.0, "agent_error", repr(e)
            else:
                with self._lock:
                    if not fut.done():  # else its thread is past its return, and ends now
                        self._hung.add(fut)
                log.warning("agent %s ran past agent.timeout_s=%g on %s; its thread runs on (%d such)", self.cfg.fn,
                            self.cfg.timeout_s, prompt.id, self.leaked)
                reward, reason, error = 0.0, "agent_timeout", f"no return within agent.timeout_s={self.cfg.timeout_s}"
        except Exception as e:  # noqa: BLE001 - an agent's failure ends its episode, never the run
            log.warning("agent %s failed on %s: %r", self.cfg.fn, prompt.id, e)
            reward, reason, error = 0.0, "agent_error", repr(e)
        finally:
            self.places.release()  # a timed-out agent's thread runs on, but holds no worker's place
        try:
            rollouts = store.end(sid, reward, reason)
        except Exception as e:  # noqa: BLE001 - a branch whose turn never ends fails its episode, not the group
            log.warning("agent %s: session %s did not end: %r", self.cfg.fn, sid, e)
            return [(np.zeros(0, np.int32), _empty("agent_timeout", f"the session's episode did not end: {e!r}"))]
        if not rollouts:
            return [(np.zeros(0, np.int32), _empty("agent_no_call" if reason == "done" else reason, error))]
        done = [(r.prompt_tokens, r.completions[0]) for r in rollouts]  # its branches, oldest first
        for _, c in done[:-1]:  # the agent moved on from these: open until now, or ended when the render diverged
            if c.end_reason in ("done", reason):
                c.end_reason = "branched"
        last = done[-1][1]  # the branch the agent ended on
        last.end_reason = reason
        if error:
            last.env_info.append({"error": error})
        return done

    def run_group(self, prompt: Prompt) -> Rollout:
        """The group of `prompt.n` episodes, each its own session (their agents run side by side), with their
        branches as `agent.branches` says (eval groups score episodes: their last branches only)."""
        with ThreadPoolExecutor(prompt.n) as ex:  # waits on the agents, which run on threads of their own
            episodes = list(ex.map(lambda _: self._episode(prompt), range(prompt.n)))
        keep = self.cfg.branches == "keep" and not prompt.is_eval
        head, done = fold(choose_branches(episodes, self.cfg.branch_rows if keep else 0))
        return Rollout(prompt, head, done, worker=self.server.engine.name)


Trajectory = tuple[np.ndarray, Completion]  # one branch of an episode: its prompt ids and its completion


def choose_branches(episodes: list[list[Trajectory]], extra: int) -> list[Trajectory]:
    """The trajectories a group trains: every episode's last branch, and up to `extra` earlier ones (0: 'drop').
    Past `extra`, the earliest branches of the episode holding the most go first (no episode's branches crowd out
    the others'); each episode's last branch counts what it lost in its `env_info` ("dropped_branches")."""
    kept = [list(e) for e in episodes]
    while sum(len(e) for e in kept) - len(kept) > extra:
        max(kept, key=len).pop(0)  # the last branch always stays: len(e) > 1 for the longest while over `extra`
    out = []
    for e, k in zip(episodes, kept):
        if len(e) > len(k):
            k[-1][1].env_info.append({"dropped_branches": len(e) - len(k)})
        out.extend(k)
    return out


def fold(episodes: list[tuple[np.ndarray, Completion]]) -> tuple[np.ndarray, list[Completion]]:
    """One group's prompt and completions from episodes whose prompts may differ (each agent renders its own first
    messages): the group's prompt is their common prefix, and each episode's rest of its prompt opens its completion
    as forced observation tokens (context, out of the loss), so every trained sequence is still exactly its ids."""
    prompts = [p for p, _ in episodes if len(p)]
    head = prompts[0] if prompts else np.zeros(0, np.int32)
    for p in prompts[1:]:
        n = min(len(head), len(p))
        same = np.nonzero(head[:n] != p[:n])[0]
        head = head[: same[0] if len(same) else n]
    out = []
    for p, c in episodes:
        rest = np.asarray(p[len(head):], np.int32)
        if not len(rest):
            out.append(c)
            continue
        k, v = len(rest), c.prompt_version or 0
        turns = c.turns if c.turns is not None else np.zeros(len(c.tokens), np.int32)
        obs = c.observation if c.observation is not None else np.zeros(len(c.tokens), bool)
        out.append(Completion(
            tokens=np.concatenate([rest, c.tokens]), logprobs=np.concatenate([np.zeros(k, np.float32), c.logprobs]),
            forced=np.concatenate([np.ones(k, bool), c.forced]),
            versions=np.concatenate([np.full(k, v, np.int32), c.versions]), prompt_version=c.prompt_version,
            text=c.text, finish_reason=c.finish_reason, ended_thinking=c.ended_thinking, reward=c.reward,
            reason=c.reason, turns=np.concatenate([np.zeros(k, np.int32), turns]),
            observation=np.concatenate([np.ones(k, bool), obs]), end_reason=c.end_reason,
            turn_texts=c.turn_texts, env_s=c.env_s, env_info=c.env_info))
    return np.asarray(head, np.int32), out
