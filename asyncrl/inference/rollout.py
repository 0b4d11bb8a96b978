"""Rollout records: what the inference engine hands the trainer (token in, token out).

One `Rollout` per prompt holds its group of `group_size` completions. Each completion keeps the raw sampled
ids and logprobs, a mask of tokens the engine forced (EOS at the length limit, the reasoning-budget phrase) so
the loss can leave them out, and the weight version in force when each token was sampled, so staleness is
known per token and not only per sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


@dataclass
class Completion:
    tokens: np.ndarray  # [n] int32, generated ids only (ends with EOS unless truncated by the caller)
    logprobs: np.ndarray  # [n] float32, sampler logprobs (0 for forced tokens)
    forced: np.ndarray  # [n] bool, True where the engine forced the token instead of sampling it
    versions: np.ndarray  # [n] int32, weight version in force when each token was produced
    text: str = ""
    finish_reason: str = "eos"  # "eos" (sampled EOS) or "length" (forced at max_seq_len)
    ended_thinking: bool = False  # an end-of-think token was sampled or forced (reasoning budget)
    reward: float | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not (len(self.logprobs) == len(self.forced) == len(self.versions) == n):
            raise ValueError(
                f"completion arrays disagree: tokens={n} logprobs={len(self.logprobs)} "
                f"forced={len(self.forced)} versions={len(self.versions)}"
            )

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


class PromptRef(NamedTuple):
    """Which prompt a request (and so its rollout) answers. It rides from the prompt queue through the engine to
    the trainer unchanged."""

    position: int
    """Data position: orders a step's batch, seeds the prompt's samples, and is what the feeder accounts for
    (evals: `EVAL_POSITION_BASE` + index in the eval set; the CLIs: the request's index)."""
    sample: Any
    """The task's `Sample` (id, prompt, gold answer) in a run; whatever a CLI attaches otherwise."""
    eval_round: int = -1
    """The eval round it belongs to; -1 for a train prompt."""

    @property
    def id(self) -> str:
        return str(self.sample.id)


@dataclass
class Rollout:
    """One prompt and its group of completions."""

    prompt: PromptRef | None  # what the request carried (None: a bare request)
    prompt_tokens: np.ndarray  # [p] int32
    completions: list[Completion] = field(default_factory=list)
    group_size: int = 1
    is_eval: bool = False
    uid: int = -1  # engine-wide prompt counter (keeps groups apart across replicas)
    worker: str = ""  # which inference worker / replica produced it

    @property
    def done(self) -> bool:
        return len(self.completions) >= self.group_size

    @property
    def oldest_version(self) -> int:
        """The blog's `lag` base: the oldest weight version any token of this group was sampled with."""
        return min((int(c.versions.min()) for c in self.completions if len(c.versions)), default=0)

    @property
    def label(self) -> str:
        """For messages: the sample's id, or the data position of a request that carried no task sample."""
        if self.prompt is None:
            return "no prompt ref"
        return self.prompt.id if hasattr(self.prompt.sample, "id") else f"position {self.prompt.position}"

    @property
    def rewards(self) -> np.ndarray:
        if any(c.reward is None for c in self.completions):
            raise ValueError(f"rollout {self.uid} ({self.label}) has unscored completions")
        return np.asarray([c.reward for c in self.completions], np.float32)
