"""The records of one rollout, from the prompt feeder through the inference engine to the trainer (token in,
token out). Neutral ground: inference produces them and train consumes them, and this module imports neither.

- `Prompt`: one prompt of the data stream, the only wrapper a task sample gets. It rides the prompt queue, the
  engine and the rollout queue unchanged, and says everything the pipeline keys on: the data position (orders a
  step's batch, is what the feeder accounts for), the group size, the eval round, and the seed (`uid`).
- `Completion`: one sampled completion. Raw sampled ids, sampler logprobs, a mask of tokens the engine forced
  (EOS at the length limit, the reasoning-budget phrase) so the loss can leave them out, and the weight version
  in force when each token was sampled, so staleness is known per token and not only per sample; and the version
  that computed the prompt's cache, which the lag counts too. With router replay (train.moe.router_replay), the
  experts each token was routed to at each MoE layer, which the trainer replays.
- `Rollout`: a prompt and its group of completions.
- `Environment`: what a completion is sampled in. It opens the episode (the prompt's token ids), then answers each
  model `Turn` with a `StepResult`: an observation to append (token ids), a reward, done. A single-turn task is a
  one-step environment (its step grades the answer with the task's verifier), so there is one rollout path. A
  multi-turn completion keeps the observations in its token arrays as forced tokens: the trajectory is exactly the
  ids the sampler saw, never re-tokenized, and the loss leaves the observations out.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

EVAL_POSITION_BASE = 1_000_000_000
"""Eval prompts' positions: `EVAL_POSITION_BASE + index in the eval set`, so they (and their seeds) never meet a
train position."""
_EVAL_ROUND_STRIDE = 7919  # a prime: each eval round samples its fixed prompts with fresh seeds


def prompt_uid(position: int, eval_round: int = -1) -> int:
    """The seed of a prompt's samples (with the engine seed and the sample index): its data position for a train
    prompt, so a resumed run regenerates a position exactly; shifted per round for an eval prompt, whose position
    repeats every round."""
    return position if eval_round < 0 else position + _EVAL_ROUND_STRIDE * (eval_round + 1)


@dataclass(frozen=True)
class Prompt:
    """One prompt, as the feeder releases it and the trainer receives it back in its `Rollout`."""

    position: int
    """Data position: orders a step's batch, seeds the prompt's samples, and is what the feeder accounts for
    (evals: `EVAL_POSITION_BASE` + index in the eval set; the CLIs: the request's index)."""
    sample: Any = None
    """The task's `Sample` (id, prompt, gold answer) in a run; whatever a CLI attaches otherwise."""
    n: int = 1
    """Completions to sample: the group size."""
    eval_round: int = -1
    """The eval round it belongs to; -1 for a train prompt."""

    @staticmethod
    def for_eval(index: int, sample: Any, n: int, eval_round: int) -> Prompt:
        return Prompt(EVAL_POSITION_BASE + index, sample, n, eval_round)

    @property
    def is_eval(self) -> bool:
        return self.eval_round >= 0

    @property
    def uid(self) -> int:
        return prompt_uid(self.position, self.eval_round)

    @property
    def id(self) -> str:
        """For logs and messages: the sample's id, else the data position."""
        sid = getattr(self.sample, "id", None)
        return str(sid) if sid is not None else f"position {self.position}"


@dataclass
class Completion:
    tokens: np.ndarray  # [n] int32, generated ids only (ends with EOS unless truncated by the caller)
    logprobs: np.ndarray  # [n] float32, sampler logprobs (0 for forced tokens)
    forced: np.ndarray  # [n] bool, True where the engine forced the token instead of sampling it
    versions: np.ndarray  # [n] int32, weight version in force when each token was produced
    prompt_version: int | None = None  # the version that computed the prompt's KV cache (the prefill's)
    text: str = ""  # the last model turn's text (the answer graded); `Turn.text` of each turn is in `turn_texts`
    finish_reason: str = "eos"  # how the last turn ended: "eos", "stop" (a stop sequence) or "length"
    ended_thinking: bool = False  # an end-of-think token was sampled or forced (reasoning budget)
    reward: float | None = None
    reason: str | None = None
    turns: np.ndarray | None = None  # [n] int32, the model turn each token belongs to (observations: the turn
    #                                  they answer); None: one turn
    observation: np.ndarray | None = None  # [n] bool, tokens the environment appended (also `forced`)
    end_reason: str = "done"  # why the episode ended: "done" (the environment), "max_turns", "context", "obs_cap",
    #                           "env_error" (its environment failed or gave no observation)
    turn_texts: list[str] = field(default_factory=list)
    env_s: float = 0.0  # seconds spent in environment steps
    env_info: list[dict] = field(default_factory=list)  # each environment step's non-empty `StepResult.info`
    routes: np.ndarray | None = None  # [n, Lm, k] int8 (int16 past 128 experts): each token's experts at each MoE
    #                                   layer as the sampler routed it (train.moe.router_replay), -1 where the
    #                                   trainer's router chooses (forced and observation tokens); None: not recorded

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not (len(self.logprobs) == len(self.forced) == len(self.versions) == n):
            raise ValueError(
                f"completion arrays disagree: tokens={n} logprobs={len(self.logprobs)} "
                f"forced={len(self.forced)} versions={len(self.versions)}"
            )
        for name in ("turns", "observation", "routes"):
            a = getattr(self, name)
            if a is not None and len(a) != n:
                raise ValueError(f"completion arrays disagree: tokens={n} {name}={len(a)}")

    @property
    def n_turns(self) -> int:
        return 1 if self.turns is None or not len(self.turns) else int(self.turns.max()) + 1

    @property
    def observation_tokens(self) -> int:
        return 0 if self.observation is None else int(self.observation.sum())

    @property
    def oldest_version(self) -> int:
        """The oldest weights behind this completion: any token's, or the prompt cache's it was decoded from."""
        vs = [int(self.versions.min())] if len(self.versions) else []
        if self.prompt_version is not None:
            vs.append(self.prompt_version)
        return min(vs, default=0)

    @property
    def start_version(self) -> int:
        return int(self.versions[0]) if len(self.versions) else 0

    @property
    def end_version(self) -> int:
        return int(self.versions[-1]) if len(self.versions) else 0

    @property
    def version_boundaries(self) -> list[tuple[int, int]]:
        """(token index, new version) wherever an in-flight weight update landed inside this completion."""
        v = self.versions
        return [(int(i), int(v[i])) for i in np.nonzero(np.diff(v))[0] + 1] if len(v) > 1 else []


@dataclass
class Rollout:
    """One prompt and its group of completions."""

    prompt: Prompt
    prompt_tokens: np.ndarray  # [p] int32
    completions: list[Completion] = field(default_factory=list)
    worker: str = ""  # which inference worker / replica produced it

    @property
    def group_size(self) -> int:
        return self.prompt.n

    @property
    def is_eval(self) -> bool:
        return self.prompt.is_eval

    @property
    def done(self) -> bool:
        return len(self.completions) >= self.group_size

    @property
    def oldest_version(self) -> int:
        """The blog's `lag` base: the oldest weight version any token of this group was sampled with, or any prompt
        cache it was decoded from (`Completion.oldest_version`)."""
        return min((c.oldest_version for c in self.completions if len(c.versions) or c.prompt_version is not None),
                   default=0)

    @property
    def rewards(self) -> np.ndarray:
        if any(c.reward is None for c in self.completions):
            raise ValueError(f"rollout of {self.prompt.id} (data position {self.prompt.position}) has unscored "
                             "completions")
        return np.asarray([c.reward for c in self.completions], np.float32)


@dataclass(frozen=True)
class Turn:
    """One model turn, as an environment sees it: the exact sampled ids (never re-tokenized), their text, its
    index, how it ended ("eos", "stop", "length"), and whether it is the last the engine allows (`max_turns`, the
    context): the environment must then end the episode (`done`) and give its final reward."""

    tokens: np.ndarray
    text: str
    index: int
    finish: str
    last: bool
    # The sampler's records of the turn's tokens, for an environment that hands the turn on (the endpoint's
    # sessions answer an agent's call with them); None where a caller builds a turn by hand.
    logprobs: np.ndarray | None = None
    forced: np.ndarray | None = None
    versions: np.ndarray | None = None


@dataclass(frozen=True)
class StepResult:
    """An environment's answer to a turn: the observation's token ids to append before the next turn (rendered with
    the chat template's turn delimiters, encoded once), the reward, and whether the episode is over."""

    observation: Sequence[int] | None
    reward: float
    done: bool
    reason: str | None = None  # for logs and metrics: "correct", "tool_error", ...
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """An episode, created per sampled trajectory. `reset` opens it with the prompt's token ids (every trajectory
    of a group opens identically); `step` answers each model turn. `step` may be slow (a tool, a game, a verifier):
    the engine runs it off its decode thread. What ends a model turn besides EOS (a tool call's closing tag) is its
    environment's (`asyncrl.envs.EnvironmentSpec.stop`): the engine's decode program compiles in the union over the
    run's environments (`Environments.stop_sequences`)."""

    def reset(self) -> list[int]: ...

    def step(self, turn: Turn) -> StepResult: ...


@runtime_checkable
class AsyncEnvironment(Protocol):
    """An episode whose answers come on their own time (a session's: its agent's next call): `step_async` returns at
    once, and the engine waits on the future without holding one of its environment threads meanwhile."""

    def reset(self) -> list[int]: ...

    def step_async(self, turn: Turn) -> Future[StepResult]: ...
