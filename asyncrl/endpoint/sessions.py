"""Sessions: an agent's calls of one episode, trained token-exact.

A call that names a session (`session_id`, an extra body field) belongs to that episode. The server keeps each
branch's exact token history: the prompt ids, then each sampled turn's ids and each observation's. A call whose
messages extend a branch's (every earlier message equal, the assistant's as the server wrote them, then new
non-assistant messages) is built as the stored tokens plus the new messages' tokens alone (`ObservationRenderer`:
what the template puts after the model's turn end), and its episode goes on in the engine as any multi-turn episode
does: its row's cache waits in the park store while the agent works, and is continued (fed or extended), never
recomputed. Earlier turns are never re-rendered or re-tokenized, which is where token drift comes from: a template
renders a sampled `<tool_call>{"name":"add",...}` back as `<tool_call>\\n{"name": "add", ...}\\n`.

A call that edits earlier history (or changes the tools, or comes while the branch is busy or at its last turn, or
adds messages after which the chat template renders the earlier turns differently, as Qwen3's does after a new user
message) starts a new branch from a fresh render, recorded in its prompt's sample (`SessionSample.branch`). Each
branch is its own episode and reaches the trainer as its own trajectory when the session ends (`SessionStore.end`,
with the reward).

Each episode's environment is a `SessionEnv`: its step hands the sampled turn to the waiting call and waits for the
next call's observation on a future (no engine thread held while the agent works), at most `endpoint.session_idle_s`;
an idle session's episodes end (reason "session_idle")."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from asyncrl.endpoint.chat import Reply
from asyncrl.endpoint.loop import Overloaded
from asyncrl.endpoint.protocol import ApiError, ChatRequest
from asyncrl.endpoint.responses import TurnOut
from asyncrl.envs.chat import ObservationRenderer
from asyncrl.inference.engine import Request
from asyncrl.rollout import Prompt, Rollout, StepResult, Turn


@dataclass(frozen=True)
class SessionSample:
    """What a session's episode carries as its prompt's sample (into its `Rollout`)."""

    session: str
    branch: int

    @property
    def id(self) -> str:
        return f"{self.session}/{self.branch}"


@dataclass
class _Command:
    observation: list[int] | None = None  # go on with these ids; None: end the episode
    waiter: Future | None = None  # gets the next turn
    reward: float = 0.0
    reason: str = "done"


class SessionEnv:
    """The environment of one branch: relays turns out to the calls and their observations in. An
    `AsyncEnvironment`: while the agent works, the episode waits on a future, holding no engine thread (open sessions
    would otherwise fill the engine's environment threads and stall every episode's steps behind them)."""

    stop: tuple = ()

    def __init__(self, prompt: list[int], idle_s: float, waiter: Future,
                 later: Callable[[float, Callable[[], None]], None]):
        """`later(seconds, fn)`: calls `fn` after `seconds` (the server's event loop: the idle timeout's timer)."""
        self.prompt, self.idle_s, self.waiter, self.later = prompt, idle_s, waiter, later
        self._commands: deque[_Command] = deque()  # sent before the engine asked
        self._next: Future | None = None  # the engine's wait for the next command
        self._steps = 0
        self._lock = threading.Lock()

    def reset(self) -> list[int]:
        return list(self.prompt)

    def step_async(self, turn: Turn) -> Future:
        if self.waiter is not None:
            self.waiter.set_result(turn)
            self.waiter = None
        fut: Future = Future()
        with self._lock:
            self._steps += 1
            step = self._steps
            cmd = self._commands.popleft() if self._commands else None
            if cmd is None:
                self._next = fut
        if cmd is not None:
            fut.set_result(self._result(cmd))
        else:
            # The timer lives session_idle_s whatever happens meanwhile: it holds the env weakly, so an answered
            # step's env (its prompt, waiter, queue) is not kept alive by its pending timer.
            ref = weakref.ref(self)
            self.later(self.idle_s, lambda: (env := ref()) is not None and env._expire(step))
        return fut

    def send(self, cmd: _Command) -> None:
        """The next call's observation, or the end of the episode."""
        with self._lock:
            fut, self._next = self._next, None
            if fut is None:
                self._commands.append(cmd)
                return
        fut.set_result(self._result(cmd))

    def _expire(self, step: int) -> None:
        with self._lock:
            if self._next is None or self._steps != step:  # answered meanwhile
                return
            fut, self._next = self._next, None
        fut.set_result(StepResult(None, 0.0, True, "session_idle"))

    def _result(self, cmd: _Command) -> StepResult:
        if cmd.observation is None:
            return StepResult(None, cmd.reward, True, cmd.reason)
        self.waiter = cmd.waiter
        return StepResult(cmd.observation, 0.0, False)


def _norm(m: dict[str, Any]) -> tuple:
    """A message as compared for prefix matching: OpenAI's client sends back more fields than it got (ids, nulls),
    and a call's arguments as a JSON string that may be spaced differently."""
    def args(a: Any) -> str:
        try:
            a = json.loads(a) if isinstance(a, str) else a
        except json.JSONDecodeError:
            pass
        return json.dumps(a, sort_keys=True)

    calls = tuple((c["function"].get("name"), args(c["function"].get("arguments"))) for c in m.get("tool_calls") or [])
    return m["role"], m.get("content") or "", calls, m.get("tool_call_id") or ""


@dataclass
class Branch:
    index: int
    tools_key: str
    env: SessionEnv
    rollout: Future
    messages: list[dict[str, Any]] = field(default_factory=list)  # as the agent will send them back
    ids: list[int] = field(default_factory=list)  # the exact context: prompt, turns, observations
    last: Turn | None = None
    busy: bool = True  # a call is waiting on its turn
    ended_at: float | None = None  # when its episode ended (monotonic), for eviction

    def __post_init__(self) -> None:
        self.rollout.add_done_callback(lambda _: setattr(self, "ended_at", time.monotonic()))

    def extends(self, messages: list[dict[str, Any]], tools_key: str) -> bool:
        n = len(self.messages)
        return (not self.busy and self.last is not None and not self.last.last and tools_key == self.tools_key
                and len(messages) > n and all(_norm(a) == _norm(b) for a, b in zip(messages, self.messages))
                and all(m["role"] != "assistant" for m in messages[n:]))


class SessionStore:
    """The sessions of one server: each session's branches, until `end` hands over their rollouts."""

    MAX_CLOSED = 4096  # ended sessions remembered (a late call refused); older ones are forgotten
    MAX_RENDERERS = 32  # observation renderers kept, one per distinct `tools` list

    def __init__(self, idle_s: float = 300.0):
        self.idle_s = idle_s
        self.sessions: dict[str, list[Branch]] = {}
        self.closed: OrderedDict[str, None] = OrderedDict()  # ended sessions: a late call (a timed-out agent's) is
        #                                                     refused
        self._renderers: OrderedDict[str, ObservationRenderer] = OrderedDict()
        self._lock = threading.Lock()

    def _evict(self) -> None:
        """Forget sessions nobody ended (a client that named a session and went away): every branch's episode over
        (idle past `idle_s`, or at its limits) for `idle_s` more. An agent's session is ended by its runner first."""
        now = time.monotonic()
        for sid in [sid for sid, bs in self.sessions.items()
                    if bs and all(b.ended_at is not None and now - b.ended_at > self.idle_s for b in bs)]:
            del self.sessions[sid]

    def _renderer(self, server: Any, tools: list[dict[str, Any]], key: str) -> ObservationRenderer:
        if key not in self._renderers:
            chat = server.chat
            self._renderers[key] = ObservationRenderer(chat.tokenizer, chat.format.turn_end if chat.native else None,
                                                       **chat.template_kwargs(tools))
            while len(self._renderers) > self.MAX_RENDERERS:
                self._renderers.popitem(last=False)
        self._renderers.move_to_end(key)
        return self._renderers[key]

    async def chat(self, server: Any, request: web.Request, req: ChatRequest) -> web.StreamResponse:
        if req.sampling.n != 1:
            raise ApiError(400, "n: a session's call samples one choice (its episode has one history)", "n")
        sid, key = req.session, json.dumps(req.tools, sort_keys=True)
        # Routing takes no await: calls run on one event loop, so two cannot both take a branch. `end` runs on an
        # agent's thread: the lock keeps a call from opening a branch of a session that `end` has just taken.
        with self._lock:
            branch, prompt_ids, waiter = self._route(server, req, sid, key)  # type: ignore[arg-type]
        turn = await self._turn(server, branch, waiter)
        reply = server.chat.reply(turn.tokens, req.tools if req.tool_choice != "none" else [],
                                  turn.finish == "length")
        branch.ids, branch.last, branch.busy = prompt_ids + [int(t) for t in turn.tokens], turn, False
        branch.messages = list(req.messages) + [self._message(reply)]
        out = TurnOut(turn.tokens, turn.logprobs, turn.forced, turn.versions, turn.finish == "length")
        extra = {"session_id": sid, "branch": branch.index, "turn": turn.index}
        return await server.answer_chat(request, req, prompt_ids, [out], extra, [reply])

    def _route(self, server: Any, req: ChatRequest, sid: str, key: str) -> tuple[Branch, list[int], Future]:
        """The branch this call continues (its observation sent to the episode) or a new one (submitted)."""
        if sid in self.closed:
            raise ApiError(409, f"session_id: session {sid!r} has ended", "session_id")
        if sid not in self.sessions:
            self._evict()
        branches = self.sessions.setdefault(sid, [])
        branch = next((b for b in reversed(branches) if b.extends(req.messages, key)), None)
        waiter: Future = Future()
        obs: list[int] = []
        if branch is not None:
            try:
                obs = self._renderer(server, req.tools, key).after(branch.last.tokens,
                                                                   req.messages[len(branch.messages):])
            except ValueError:  # the template re-renders earlier turns once these follow (Qwen3 after a new user
                # message): the history is not a prefix of any render. A new branch; the old one's history has
                # moved on, so its episode ends now (its row and cache freed) and gets its reward at `end`.
                branch.env.send(_Command(reason="branched"))
                branch.busy = True  # never extended again
                branch = None
        if branch is not None:
            server.check_context(branch.ids + obs, "messages")
            prompt_ids = branch.ids + obs
            branch.busy = True
            branch.env.send(_Command(observation=obs, waiter=waiter))
            return branch, prompt_ids, waiter
        prompt_ids = server.chat.prompt_ids(req.messages, req.tools)
        server.check_context(prompt_ids, "messages")
        env = SessionEnv(prompt_ids, self.idle_s, waiter, server.later)
        index = len(branches)
        prompt = Prompt(server.next_position(), SessionSample(sid, index), 1)  # type: ignore[arg-type]
        try:
            rollout = server.loop.submit(Request(prompt, prompt_ids, [env]), session=True)
        except Overloaded as e:
            if not branches:
                del self.sessions[sid]
            raise ApiError(429, f"the engine is at capacity: {e}; retry later", None, "rate_limit_exceeded") from e
        branch = Branch(index, key, env, rollout)
        branches.append(branch)
        return branch, prompt_ids, waiter

    @staticmethod
    def _message(reply: Reply) -> dict[str, Any]:
        m: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            m["tool_calls"] = reply.tool_calls
        return m

    async def _turn(self, server: Any, branch: Branch, waiter: Future) -> Turn:
        """The next turn of `branch`, or an ApiError if its episode ended without one."""
        turn_f, ended_f = asyncio.wrap_future(waiter), asyncio.wrap_future(branch.rollout)
        done, _ = await asyncio.wait({turn_f, ended_f}, timeout=server.cfg.request_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if turn_f in done:
            return turn_f.result()
        if ended_f in done:
            why = ended_f.exception() or ended_f.result().completions[0].end_reason
            raise ApiError(500, f"the session's episode ended without a turn: {why}", None, "server_error")
        raise ApiError(504, f"no turn within endpoint.request_timeout_s={server.cfg.request_timeout_s}", None,
                       "timeout")

    def end(self, session: str, reward: float, reason: str = "done", timeout: float = 60.0) -> list[Rollout]:
        """End every branch of `session` with `reward`; returns their rollouts once the engine has emitted them.
        The session is closed first: a later call naming it (a timed-out agent's) is refused, never a new branch."""
        with self._lock:
            self.closed[session] = None
            while len(self.closed) > self.MAX_CLOSED:
                self.closed.popitem(last=False)
            branches = self.sessions.pop(session, [])
        for b in branches:
            b.env.send(_Command(reward=reward, reason=reason))
        out = [b.rollout.result(timeout) for b in branches]
        for r in out:  # a branch ended early ("branched") had no reward yet
            for c in r.completions:
                c.reward = reward
        return out
