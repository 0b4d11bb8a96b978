"""Host-side bookkeeping of the engine's trajectories: one `Episode` per sampled completion, one `Group` per prompt.

An episode accumulates its token arrays turn by turn, exactly as the device saw them: each model turn's sampled ids
(with their logprobs, forced mask and weight versions), then each observation's ids (forced, logprob 0, the version
that computed their keys and values). Every version is written once, when the decode row that holds it comes back to
the host (`Episode.add_turn`): the device decided it (the prefill's, the extend's, or each feeding decode step's).
Nothing is ever decoded and re-encoded. When the environment says done, or a limit ends the episode, it becomes a
`Completion`; when every episode of a group has, the group is a `Rollout`.

A continuation is the next model turn of an episode: `feed` is the last sampled token (the device stopped before
feeding it) followed by the observation. Either decode steps feed it, a token a step, in the row it goes back to
(`Fed`, `parking.ParkPrograms._continuation`), or the engine appends `feed[:-1]` to the row's saved KV cache
and decodes on from `feed[-1]` (`parking.ParkPrograms._extend_fn`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.inference.state import DecodeState
from asyncrl.rollout import Completion, Environment, Rollout, StepResult


@dataclass
class Part:
    """A run of tokens of one episode: a model turn or an observation."""

    tokens: np.ndarray
    logprobs: np.ndarray
    forced: np.ndarray
    versions: np.ndarray | None  # None: an observation whose decode row has not come back yet (`Episode.add_turn`)
    turn: int
    observation: bool
    routes: np.ndarray | None = None  # [n, Lm, k] recorded experts (router replay); None: an observation, or none


@dataclass
class Episode:
    env: Environment | None
    prompt_len: int
    parts: list[Part] = field(default_factory=list)
    turn: int = 0  # model turns taken
    prompt_version: int | None = None
    finish: str = "eos"  # how the last model turn ended
    ended_thinking: bool = False
    reward: float | None = None
    reason: str | None = None
    end_reason: str = "done"
    texts: list[str] = field(default_factory=list)
    env_s: float = 0.0
    env_info: list[dict] = field(default_factory=list)
    done: bool = False

    @property
    def length(self) -> int:
        """Tokens in the context: the prompt and every part."""
        return self.prompt_len + sum(len(p.tokens) for p in self.parts)

    def add_turn(self, tokens: np.ndarray, logprobs: np.ndarray, forced: np.ndarray, versions: np.ndarray,
                 text: str, finish: str, ended_thinking: bool, context_versions: np.ndarray,
                 routes: np.ndarray | None = None) -> None:
        """A model turn, as its decode row came back. `context_versions`: the row's versions before the turn (its
        prompt, or the history and the observation just fed): the first turn's give the prompt's version, a later
        one's the versions of the observation before it, the weights that took it in (an extend's or a prefill's,
        or each decode step's that fed a token)."""
        if self.turn == 0:
            self.prompt_version = int(context_versions[0])
        elif self.parts and self.parts[-1].versions is None:
            obs = self.parts[-1]
            obs.versions = np.asarray(context_versions[len(context_versions) - len(obs.tokens):], np.int32)
        self.parts.append(Part(tokens, logprobs, forced, versions, self.turn, False, routes))
        self.texts.append(text)
        self.finish, self.ended_thinking = finish, ended_thinking
        self.turn += 1

    def add_observation(self, tokens: np.ndarray) -> None:
        """The environment's answer, recorded as it goes back to the device; its versions come with the next turn."""
        n = len(tokens)
        self.parts.append(Part(np.asarray(tokens, np.int32), np.zeros(n, np.float32), np.ones(n, bool), None,
                               self.turn - 1, True))

    def end(self, result: StepResult | None, end_reason: str = "done") -> None:
        """Over: by the environment (`done`), by a limit (`end_reason`: the reward of its last step stands), or, with
        no environment (`result` None), unscored."""
        if result is not None:
            self.reward, self.reason = float(result.reward), result.reason
        self.end_reason, self.done = end_reason, True

    def history(self, prompt: np.ndarray) -> np.ndarray:
        """Every token of the context: for a re-prefill when the row's saved cache was not kept."""
        return np.concatenate([prompt, *(p.tokens for p in self.parts)]).astype(np.int32)

    def completion(self) -> Completion:
        assert all(p.versions is not None for p in self.parts), "an observation's row never came back"
        cat = lambda name, dtype: np.concatenate([getattr(p, name) for p in self.parts]).astype(dtype) \
            if self.parts else np.zeros(0, dtype)  # noqa: E731
        turns = np.concatenate([np.full(len(p.tokens), p.turn, np.int32) for p in self.parts]) if self.parts \
            else np.zeros(0, np.int32)
        obs = np.concatenate([np.full(len(p.tokens), p.observation) for p in self.parts]) if self.parts \
            else np.zeros(0, bool)
        return Completion(
            routes=self._routes(),
            tokens=cat("tokens", np.int32), logprobs=cat("logprobs", np.float32), forced=cat("forced", bool),
            versions=cat("versions", np.int32), prompt_version=self.prompt_version,
            text=self.texts[-1] if self.texts else "", finish_reason=self.finish, ended_thinking=self.ended_thinking,
            reward=self.reward, reason=self.reason, turns=turns, observation=obs, end_reason=self.end_reason,
            turn_texts=list(self.texts), env_s=self.env_s, env_info=[dict(i) for i in self.env_info],
        )

    def _routes(self) -> np.ndarray | None:
        """[n, Lm, k] over every part (observations: -1), if the turns recorded routes."""
        turns = [p.routes for p in self.parts if p.routes is not None]
        if not turns:
            return None
        full = lambda p: p.routes if p.routes is not None else np.full(  # noqa: E731
            (len(p.tokens), *turns[0].shape[1:]), -1, turns[0].dtype)
        return np.concatenate([full(p) for p in self.parts])


@dataclass
class Group:
    rollout: Rollout
    episodes: list[Episode]

    @property
    def done(self) -> bool:
        return all(e.done for e in self.episodes)

    def finish(self) -> Rollout:
        self.rollout.completions = [e.completion() for e in self.episodes]
        return self.rollout


@dataclass(frozen=True)
class Target:
    """One sample of a group: where a decode row's tokens go."""

    group: Group
    k: int

    @property
    def episode(self) -> Episode:
        return self.group.episodes[self.k]


@dataclass
class Continuation:
    """An episode's next turn, ready to go back into the decode batch."""

    group: Group
    k: int
    feed: np.ndarray  # [last sampled token, *observation]
    park: int  # the park-store row holding its KV cache, or -1 (not kept: re-prefill the history)
    info: dict[str, Any] = field(default_factory=dict)
    ready_at: float = field(default_factory=time.monotonic)

    @property
    def target(self) -> Target:
        return Target(self.group, self.k)


@dataclass
class Fed:
    """A queued continuation that goes into a decode row from its park row, its feed forced by decode steps."""

    park: int
    feed: np.ndarray


@dataclass
class Queued:
    """A sample waiting for a decode slot: row `row` of a prefill or extend batch (`source`, a `DecodeState`), or a
    continuation fed from its park row (`source`, a `Fed`; `row` unused)."""

    source: DecodeState | Fed
    row: int
    target: Target


@dataclass
class Stepping:
    """An episode whose environment is stepping: `park` the park row holding its cache (-1: none), `last` whether
    the turn was its last."""

    future: Future
    target: Target
    park: int
    last: bool
