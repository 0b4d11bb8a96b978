"""What every task is: samples in, a score out (an environment pairs its task with its episodes: `asyncrl/envs`).

A `Task` is deliberately small: `samples(split, seed)` yields prompts with their gold answers, and
`score(completion, sample)` grades one completion. Scoring is a pure function of its arguments, so the
`Verifier` can run it in worker processes (tasks are pickled once per worker; see `Task.__getstate__`).
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

Prompt = str | list
"""Plain text, or chat messages as a list of {"role": ..., "content": ...} dicts."""

SPLITS = ("train", "eval")

# Every reason a Score may carry; the trainer logs counts per reason, so the set is closed.
REASONS = (
    "correct",  # reward is the task's full reward
    "wrong",  # an answer was found and graded below full reward
    "no_answer",  # no answer in the task's format was found in the completion
    "rejected",  # the extracted answer failed a cheap safety pre-filter (too long, too deep, absurd exponent)
    "timeout",  # grading exceeded the verifier's time limit
    "error",  # grading raised, or its worker died; reward 0 rather than a crashed run
)


@dataclass(frozen=True)
class Sample:
    """One prompt with its gold answer."""

    id: str
    """Unique within its task (a mixture prefixes the source label)."""
    prompt: Prompt
    """Text for plain templates, or a list of chat messages."""
    answer: str
    """Gold answer, as the task's scorer expects it."""
    metadata: dict = field(default_factory=dict)
    """Task-specific extras (source, subject, level, generator entry); must be picklable."""


@dataclass(frozen=True)
class Score:
    """The grade of one completion."""

    reward: float
    """In [0, 1]."""
    reason: str
    """One of `REASONS`."""
    extracted: str | None = None
    """The answer that was graded (truncated), for logs; None when none was found."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"Score.reward={self.reward!r} is outside [0, 1]")
        if self.reason not in REASONS:
            raise ValueError(f"Score.reason={self.reason!r}; allowed: {list(REASONS)}")

    @property
    def correct(self) -> bool:
        return self.reason == "correct"


class Task(abc.ABC):
    """A source of prompts plus the rule that grades completions for them."""

    name: str = "task"
    label: str = "task"
    """Names this source in sample ids, metadata["task"] and per-source metrics; unique within a mixture."""
    # Attributes rebuilt lazily after unpickling (file contents, generator objects): a verifier worker needs
    # only what `score` reads, so these are not shipped to it.
    _transient: tuple[str, ...] = ()

    @abc.abstractmethod
    def samples(self, split: str, seed: int) -> Iterator[Sample]:
        """Yield samples of `split` ("train": endless stream; "eval": finite, held out from train).

        Both are deterministic functions of `seed`; use the same seed for both so the hold-out holds.
        """

    @abc.abstractmethod
    def score(self, completion: str, sample: Sample) -> Score:
        """Grade `completion` (the text the model generated, without the prompt) against `sample`."""

    def render_answer(self, answer: str, sample: Sample) -> str:
        """`answer` written the way a completion for `sample` should state it (e.g. `\\boxed{answer}`): the
        target text of the format warm-start. The default is the bare answer."""
        return answer

    def warmup(self) -> None:
        """Pay one-time import/compile costs (a verifier worker calls this before taking work). An optional hook,
        not an abstract one: most tasks have nothing to warm up, so the default does nothing."""
        return None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in self._transient:
            state[key] = None
        return state


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid: must be one of {list(SPLITS)}")


def stable_hash(*parts: object) -> int:
    """A 64-bit hash that, unlike `hash()`, is the same in every process and Python run."""
    h = hashlib.blake2b(repr(parts).encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def stable_unit(*parts: object) -> float:
    """`stable_hash` mapped to [0, 1)."""
    return stable_hash(*parts) / 2.0**64
