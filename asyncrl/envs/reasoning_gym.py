"""Generated problems from reasoning-gym, graded by each generator's own `score_answer`.

Held out by construction: reasoning-gym builds item `idx` of a dataset with `Random(seed + idx)`, so train and
eval use seeds 2**39 apart (disjoint RNG streams for any realistic run length), and train additionally skips
any question whose text equals an eval question (small problem spaces do repeat).

Only reviewed generators are allowed. Several reasoning-gym scorers run `eval` or sympy's `parse_expr` (which
evaluates Python) on the model's answer; for those we admit only answers made of digits, spaces, `+-*/()`
and no `**` before the scorer sees them, so model text never reaches `eval` as anything but arithmetic.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

from asyncrl.envs.spec import EnvironmentSpec
from asyncrl.tasks.base import Sample, Score, Task, check_split
from asyncrl.tasks.config import TaskConfig, TaskSourceConfig
from asyncrl.tasks.extract import ANSWER_FORMATS, extract_answer, render_answer
from asyncrl.tasks.prompts import PromptFormat
from asyncrl.validate import ConfigError, check_choice

_ARITHMETIC_ONLY = re.compile(r"[0-9+\-*/() ]{1,200}")

# dataset -> pattern the extracted answer must fully match before the scorer sees it (None: scorer never evals)
REVIEWED: dict[str, re.Pattern[str] | None] = {
    "basic_arithmetic": None,
    "chain_sum": None,
    "gsm_symbolic": None,
    "simple_equations": None,
    "fraction_simplification": None,
    "products": None,  # multi-digit multiplication (the tool preset); scorer: decimal compare, no eval
    "countdown": _ARITHMETIC_ONLY,  # scorer: float(sympy.parse_expr(answer))
    "puzzle24": _ARITHMETIC_ONLY,  # scorer: int(sympy.parse_expr(answer))
}
CHUNK = 1000  # train items per generator instance
EVAL_OFFSET = 1 << 39
SEED_STRIDE = 1 << 40


class GymTask(Task):
    """One reasoning-gym generator; its config kwargs come from `options`."""

    name = "reasoning_gym"
    _transient = ("_scorer", "_eval_questions")

    def __init__(self, dataset: str, generator_kwargs: Mapping[str, Any] | None = None, eval_size: int = 256,
                 prompt: PromptFormat = PromptFormat(), formats: tuple[str, ...] = ("boxed", "answer_tag"),
                 label: str | None = None, use: str = "both") -> None:
        if dataset not in REVIEWED:
            raise ValueError(f"reasoning_gym dataset {dataset!r} is not reviewed; allowed: {sorted(REVIEWED)}")
        self.dataset = dataset
        self.generator_kwargs = dict(generator_kwargs or {})
        self.eval_size = eval_size
        self.prompt = prompt
        self.formats = formats
        self.label = label or dataset
        self.use = use
        self._scorer: Any = None
        self._eval_questions: dict[int, set[str]] | None = None

    def _make(self, seed: int, size: int) -> Any:
        import reasoning_gym

        return reasoning_gym.create_dataset(self.dataset, seed=seed, size=size, **self.generator_kwargs)

    def _sample(self, entry: Mapping[str, Any], split: str, index: int) -> Sample:
        meta = {"task": self.label, "dataset": self.dataset,
                "entry": {"question": entry["question"], "answer": entry["answer"], "metadata": entry["metadata"]}}
        return Sample(f"{self.label}/{split}/{index}", self.prompt.render(entry["question"]), str(entry["answer"]),
                      meta)

    def _eval_entries(self, seed: int) -> list[Mapping[str, Any]]:
        if self.eval_size == 0:
            return []
        ds = self._make(seed * SEED_STRIDE + EVAL_OFFSET, self.eval_size)
        return [ds[i] for i in range(self.eval_size)]

    def samples(self, split: str, seed: int) -> Iterator[Sample]:
        check_split(split)
        if split == "eval":
            if self.use != "train":
                for i, entry in enumerate(self._eval_entries(seed)):
                    yield self._sample(entry, "eval", i)
            return
        if self.use == "eval":
            return
        if self._eval_questions is None:
            self._eval_questions = {}
        if seed not in self._eval_questions:
            self._eval_questions[seed] = {e["question"] for e in self._eval_entries(seed)}
        held = self._eval_questions[seed]
        base = seed * SEED_STRIDE
        for chunk in range(EVAL_OFFSET // CHUNK):
            # Chunk c covers indices [c*CHUNK, (c+1)*CHUNK) of one continuous Random(base + index) stream.
            ds = self._make(base + chunk * CHUNK, CHUNK)
            for i in range(CHUNK):
                entry = ds[i]
                if entry["question"] not in held:
                    yield self._sample(entry, "train", chunk * CHUNK + i)

    def score(self, completion: str, sample: Sample) -> Score:
        answer = extract_answer(completion, self.formats)
        if answer is None:
            return Score(0.0, "no_answer")
        guard = REVIEWED[self.dataset]
        if guard is not None and (not guard.fullmatch(answer) or "**" in answer):
            return Score(0.0, "rejected", answer[:200])
        if self._scorer is None:
            self._scorer = self._make(0, 1)
        reward = float(self._scorer.score_answer(answer, sample.metadata["entry"]))
        reward = min(1.0, max(0.0, reward)) if math.isfinite(reward) else 0.0
        return Score(reward, "correct" if reward >= 1.0 else "wrong", answer[:200])

    def render_answer(self, answer: str, sample: Sample) -> str:
        return render_answer(answer, self.formats[0])

    def warmup(self) -> None:
        self._scorer = self._make(0, 1)


_OWN_OPTIONS = ("dataset", "label", "answer_formats")


def build_gym(source: TaskSourceConfig, cfg: TaskConfig, where: str) -> GymTask:
    opts = dict(source.options)
    dataset = opts.pop("dataset", None)
    check_choice(f"{where}.options.dataset", dataset, sorted(REVIEWED))
    label = opts.pop("label", None)
    formats = tuple(opts.pop("answer_formats", ("boxed", "answer_tag")))
    for f in formats:
        check_choice(f"{where}.options.answer_formats", f, ANSWER_FORMATS)
    task = GymTask(dataset, opts, eval_size=cfg.eval_size, prompt=PromptFormat.from_config(cfg), formats=formats,
                   label=label, use=source.split)
    try:
        task._make(0, 1)
    except (TypeError, AssertionError, ValueError) as e:
        raise ConfigError(f"{where}.options={dict(source.options)!r} is invalid for reasoning_gym "
                         f"{dataset!r}: {e}") from e
    return task


ENVIRONMENT = EnvironmentSpec(task=build_gym)  # single turn: the answer graded by `score`
