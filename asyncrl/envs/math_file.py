"""Math problems from local files in the layouts the datasets are published in on the Hugging Face hub.

No package ships GSM8K, MATH-500, AIME, AMC or DAPO-Math, so users point `task.sources[i].path` at their copy
(.jsonl, .json or .parquet; a glob for sharded files). The layout is recognized from the fields, or named
with `schema`, or given column by column with `field_map`. A malformed row (bad JSON, bad UTF-8, a missing
field, a wrong type) is skipped, logged with its file and line, and kept in `MathFileLoader.skipped`; only a
file that cannot be read at all is an error (reading the files: `math_loader.py`).
"""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterator, Mapping

from asyncrl.envs.math_loader import SCHEMAS, MathFileLoader, MathRow, SkippedRow, problem_key, resolve_paths
from asyncrl.envs.spec import EnvironmentSpec
from asyncrl.tasks.base import Sample, Score, Task, check_split, stable_hash, stable_unit
from asyncrl.tasks.config import TaskConfig, TaskSourceConfig
from asyncrl.tasks.extract import ANSWER_FORMATS, AnswerLimits, render_answer
from asyncrl.tasks.grading import grade, warmup_math
from asyncrl.tasks.prompts import PromptFormat
from asyncrl.validate import ConfigError, check, check_choice


class MathFileTask(Task):
    """Problems from local files, graded by the verifier's math (or exact) comparison."""

    name = "math_file"
    _transient = ("_rows", "_loader")

    def __init__(self, path: str, *, schema: str | None = None, field_map: Mapping[str, str] | None = None,
                 use: str = "both", eval_size: int = 256, prompt: PromptFormat = PromptFormat(), mode: str = "math",
                 formats: tuple[str, ...] | None = None, limits: AnswerLimits = AnswerLimits(),
                 label: str | None = None) -> None:
        self.path = path
        self.use = use
        self.eval_size = eval_size
        self.prompt = prompt
        self.mode = mode
        self.limits = limits
        self.field_map = dict(field_map or {})
        self._loader: MathFileLoader | None = MathFileLoader(path, schema, field_map)
        self._rows: list[MathRow] | None = None
        # Decided now, not at first load: a verifier worker gets a pickled copy that never loads the rows.
        layout = self._loader.resolve_schema()
        self.schema = layout
        self.label = label or (layout if layout in SCHEMAS else
                               os.path.splitext(os.path.basename(resolve_paths(path)[0]))[0])
        self.formats = formats or (SCHEMAS[layout].formats if layout in SCHEMAS else ("boxed",))

    @property
    def loader(self) -> MathFileLoader:
        if self._loader is None:  # unpickled: rows were left behind, read them again if asked
            self._loader = MathFileLoader(self.path, self.schema if self.schema in SCHEMAS else None,
                                          self.field_map or None)
        return self._loader

    @property
    def skipped(self) -> list[SkippedRow]:
        return self.loader.skipped

    def rows(self) -> list[MathRow]:
        if self._rows is None:
            rows = self.loader.load()
            if not rows:
                raise ValueError(f"task data {self.path!r}: no usable rows ({len(self.loader.skipped)} malformed)")
            self._rows = rows
        return self._rows

    def _split(self, seed: int) -> tuple[list[int], list[int]]:
        """(train row indices, eval row indices); eval holds one row per held-out problem."""
        rows = self.rows()
        if self.use == "train":
            return list(range(len(rows))), []
        first_row: dict[str, int] = {}
        for i, r in enumerate(rows):
            first_row.setdefault(problem_key(r.problem), i)
        ranked = sorted(first_row, key=lambda k: stable_unit("math_file_eval", seed, k))
        if self.use == "both" and self.eval_size >= len(ranked):
            raise ValueError(f"task data {self.path!r}: eval_size={self.eval_size} would hold out all {len(ranked)} "
                             "distinct problems; lower task.eval_size or set this source's split to train or eval")
        held = set(ranked if self.use == "eval" else ranked[: self.eval_size])
        eval_idx = [first_row[k] for k in ranked if k in held]
        train_idx = [i for i, r in enumerate(rows) if problem_key(r.problem) not in held]
        return train_idx, eval_idx

    def _sample(self, row: MathRow) -> Sample:
        meta = {"task": self.label, "schema": self.schema, **row.metadata}
        return Sample(f"{self.label}/{row.id}", self.prompt.render(row.problem), row.answer, meta)

    def samples(self, split: str, seed: int) -> Iterator[Sample]:
        check_split(split)
        train_idx, eval_idx = self._split(seed)
        rows = self.rows()
        if split == "eval":
            for i in eval_idx:
                yield self._sample(rows[i])
            return
        if not train_idx:
            return
        for epoch in itertools.count():
            order = list(train_idx)
            random.Random(stable_hash("math_file_train", seed, epoch)).shuffle(order)
            for i in order:
                yield self._sample(rows[i])

    def score(self, completion: str, sample: Sample) -> Score:
        return grade(completion, sample.answer, self.mode, self.formats, self.limits)

    def render_answer(self, answer: str, sample: Sample) -> str:
        return render_answer(answer, self.formats[0])

    def warmup(self) -> None:
        warmup_math()


_OPTIONS = ("label", "answer_formats")


def build_math_file(source: TaskSourceConfig, cfg: TaskConfig, where: str) -> MathFileTask:
    check(f"{where}.path", source.path, bool(source.path), "a file path or glob for a math_file source")
    for key in source.options:
        check_choice(f"{where}.options", key, _OPTIONS)
    formats = source.options.get("answer_formats")
    if formats is not None:
        formats = tuple(formats)
        for f in formats:
            check_choice(f"{where}.options.answer_formats", f, ANSWER_FORMATS)
    try:
        return MathFileTask(source.path, schema=source.schema, field_map=source.field_map or None, use=source.split,
                            eval_size=cfg.eval_size, prompt=PromptFormat.from_config(cfg), mode=cfg.verifier.mode,
                            formats=formats, limits=AnswerLimits(max_chars=cfg.verifier.max_answer_chars),
                            label=source.options.get("label"))
    except (OSError, ValueError) as e:  # a missing file, or one whose layout cannot be told
        raise ConfigError(f"{where}.path={source.path!r} is invalid: {e}") from e


ENVIRONMENT = EnvironmentSpec(task=build_math_file)  # single turn: the answer graded by `score`
