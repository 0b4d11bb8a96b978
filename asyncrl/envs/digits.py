"""`digits`: a task small enough for a ~100k-parameter model trained from scratch with RL on a laptop CPU.

Prompt: a few digits and a `>`, e.g. `"3 8 1 5>"`; answer: one digit given by a fixed rule, e.g. the maximum,
`"8"`. The rule is the whole task, so a model that scores well on held-out prompts has learned the rule rather
than memorized prompts. With `op: mixed` the prompt starts with a letter naming the rule (`"M 3 8 1 5>"`).

Reward (decided here, tested in tests/test_tasks_digits.py): a completion is the text generated before EOS;
with `match: exact` (default) it scores 1 iff, with surrounding whitespace stripped, it equals the answer.
So the policy must learn to stop right after the digit, which is what makes short rollouts cheap. `match:
prefix` scores 1 iff the stripped completion starts with the answer, for models without a learned EOS.

Held-out split: a prompt is eval iff a fixed hash of its text falls below `eval_fraction`, independent of the
seed, so every run and every seed holds out the same prompts and no eval prompt is ever trained on.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from asyncrl.envs.spec import EnvironmentSpec
from asyncrl.tasks.base import Sample, Score, Task, check_split, stable_hash, stable_unit
from asyncrl.tasks.config import TaskConfig, TaskSourceConfig
from asyncrl.validate import check, check_choice

# op -> (letter shown in mixed mode, rule)
OPS: dict[str, tuple[str, Callable[[tuple[int, ...]], int]]] = {
    "max": ("M", max),
    "min": ("m", min),
    "first": ("f", lambda d: d[0]),
    "last": ("l", lambda d: d[-1]),
    "sum_mod10": ("s", lambda d: sum(d) % 10),
}
CHARSET = string.digits + " >" + "".join(sorted(letter for letter, _ in OPS.values()))
"""Every character a digits prompt or answer can contain; a character tokenizer over these (plus EOS) suffices."""
MATCHES = ("exact", "prefix")


@dataclass(frozen=True)
class DigitsOptions:
    op: str = "max"
    """One of max, min, first, last, sum_mod10, or 'mixed' (rule chosen per prompt, named by a leading letter)."""
    min_digits: int = 3
    max_digits: int = 5
    eval_fraction: float = 0.1
    """Share of all possible prompts held out for eval."""
    match: str = "exact"

    def validate(self, where: str) -> None:
        check_choice(f"{where}.op", self.op, list(OPS) + ["mixed"])
        check(f"{where}.min_digits", self.min_digits, 1 <= self.min_digits <= 12, "in [1, 12]")
        check(f"{where}.max_digits", self.max_digits, self.min_digits <= self.max_digits <= 12,
              f"in [min_digits={self.min_digits}, 12]")
        check(f"{where}.eval_fraction", self.eval_fraction, 0.0 < self.eval_fraction < 1.0, "in (0, 1)")
        check_choice(f"{where}.match", self.match, MATCHES)


class DigitsTask(Task):
    name = "digits"

    def __init__(self, options: DigitsOptions = DigitsOptions(), eval_size: int = 256, label: str = "digits",
                 use: str = "both") -> None:
        options.validate("digits")
        self.options = options
        self.use = use
        self.eval_size = eval_size
        self.label = label
        self._ops = list(OPS) if options.op == "mixed" else [options.op]

    def prompt_text(self, op: str, digits: tuple[int, ...]) -> str:
        body = " ".join(map(str, digits)) + ">"
        return f"{OPS[op][0]} {body}" if self.options.op == "mixed" else body

    def is_eval(self, prompt: str) -> bool:
        return stable_unit("digits_split", prompt) < self.options.eval_fraction

    def _draw(self, rng: random.Random) -> tuple[str, tuple[int, ...]]:
        n = rng.randint(self.options.min_digits, self.options.max_digits)
        return rng.choice(self._ops), tuple(rng.randrange(10) for _ in range(n))

    def _sample(self, op: str, digits: tuple[int, ...]) -> Sample:
        prompt = self.prompt_text(op, digits)
        answer = str(OPS[op][1](digits))
        return Sample(f"{self.label}/{prompt}", prompt, answer, {"task": self.label, "op": op})

    def num_prompts(self) -> int:
        return len(self._ops) * sum(10**n for n in range(self.options.min_digits, self.options.max_digits + 1))

    def samples(self, split: str, seed: int) -> Iterator[Sample]:
        check_split(split)
        if self.use not in ("both", split):
            return
        rng = random.Random(stable_hash("digits", split, seed))
        if split == "train":
            while True:
                op, digits = self._draw(rng)
                if not self.is_eval(self.prompt_text(op, digits)):
                    yield self._sample(op, digits)
        # Distinct eval prompts by rejection sampling; the attempt cap ends the set when the eval partition
        # is smaller than eval_size (only with tiny digit ranges).
        seen: set[str] = set()
        attempts = 0
        cap = 200 * max(1, self.eval_size) + 10 * self.num_prompts()
        while len(seen) < self.eval_size and attempts < cap:
            attempts += 1
            op, digits = self._draw(rng)
            prompt = self.prompt_text(op, digits)
            if prompt not in seen and self.is_eval(prompt):
                seen.add(prompt)
                yield self._sample(op, digits)

    def score(self, completion: str, sample: Sample) -> Score:
        text = completion.strip()
        if not text:
            return Score(0.0, "no_answer")
        ok = text == sample.answer if self.options.match == "exact" else text.startswith(sample.answer)
        return Score(1.0 if ok else 0.0, "correct" if ok else "wrong", text[:20])


def build_digits(source: TaskSourceConfig, cfg: TaskConfig, where: str) -> DigitsTask:
    opts = dict(source.options)
    label = opts.pop("label", "digits")
    known = DigitsOptions.__dataclass_fields__
    for key in opts:
        check_choice(f"{where}.options", key, list(known) + ["label"])
    options = DigitsOptions(**opts)
    options.validate(f"{where}.options")
    return DigitsTask(options, eval_size=cfg.eval_size, label=str(label), use=source.split)


ENVIRONMENT = EnvironmentSpec(task=build_digits)  # single turn: the answer graded by `score`
