"""Rollout records: what the inference engine hands the trainer (token in, token out).

One `Rollout` per prompt holds its group of `group_size` completions. Each completion keeps the raw sampled
ids and logprobs, a mask of tokens the engine forced (EOS at the length limit, the reasoning-budget phrase) so
the loss can leave them out, and the weight version in force when each token was sampled, so staleness is
known per token and not only per sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class Rollout:
    """One prompt and its group of completions."""

    sample: Any  # asyncrl.tasks.base.Sample: id, prompt, gold answer, metadata
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
    def newest_version(self) -> int:
        return max((int(c.versions.max()) for c in self.completions if len(c.versions)), default=0)

    @property
    def rewards(self) -> np.ndarray:
        if any(c.reward is None for c in self.completions):
            raise ValueError(f"rollout {self.uid} ({getattr(self.sample, 'id', '?')}) has unscored completions")
        return np.asarray([c.reward for c in self.completions], np.float32)
