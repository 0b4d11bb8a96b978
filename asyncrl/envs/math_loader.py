"""Reading math problems from local files in the layouts the datasets are published in on the Hugging Face hub.

The layout is recognized from the fields (`detect_schema`), or named with `schema`, or given column by column
with `field_map`. A malformed row (bad JSON, bad UTF-8, a missing field, a wrong type) is skipped, logged with its
file and line, and kept in `MathFileLoader.skipped`; only a file that cannot be read at all is an error. The task
built on these rows is `math_files.py`.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncrl.tasks.config import MATH_FILE_SCHEMAS
from asyncrl.validate import check_choice

logger = logging.getLogger(__name__)

# DAPO-Math-17k wraps every problem in this instruction (asking for an `Answer:` line); we strip it so the
# problem gets the run's own instruction, and still accept `Answer:` lines when grading.
DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of the "
               "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
_LOGGED_SKIPS = 10  # per loader; the rest are counted and summarized in one line


class Malformed(ValueError):
    """A row that cannot become a problem; the message says which field and why."""


@dataclass(frozen=True)
class SkippedRow:
    """Where a malformed row was and why it was skipped."""

    path: str
    index: int
    """1-based line number for JSONL; 0-based row index for parquet and JSON arrays."""
    unit: str
    """'line' or 'row'."""
    reason: str

    def __str__(self) -> str:
        return f"{self.path} {self.unit} {self.index}: {self.reason}"


@dataclass(frozen=True)
class MathRow:
    problem: str
    answer: str
    id: str
    metadata: dict = field(default_factory=dict)


# ---- field access -------------------------------------------------------------------------------------------


def _get(row: Mapping[str, Any], path: str) -> Any:
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or value.get(part) is None:
            raise Malformed(f"missing field '{path}'")
        value = value[part]
    return value


def _text(row: Mapping[str, Any], path: str) -> str:
    value = _get(row, path)
    if not isinstance(value, str):
        raise Malformed(f"field '{path}' is {type(value).__name__}, expected a string")
    if not value.strip():
        raise Malformed(f"field '{path}' is empty")
    return value


def _answer_text(row: Mapping[str, Any], path: str) -> str:
    value = _get(row, path)
    # AIME files store answers as ints and AMC (aimo-validation-amc) as floats like 142.0.
    if isinstance(value, bool):
        raise Malformed(f"field '{path}' is bool, expected a string or number")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise Malformed(f"field '{path}' is {type(value).__name__ if not isinstance(value, str) else 'empty'}, "
                    "expected a string or number")


def _optional_id(row: Mapping[str, Any], path: str | None) -> str | None:
    if path is None:
        return None
    try:
        value = _get(row, path)
    except Malformed:
        return None
    return str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None


def _dapo_problem(row: Mapping[str, Any]) -> str:
    messages = _get(row, "prompt")
    if not isinstance(messages, list) or not messages:
        raise Malformed("field 'prompt' is not a non-empty list of chat messages")
    users = [m for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), str) or not users[-1]["content"].strip():
        raise Malformed("field 'prompt' has no user message with string content")
    text = users[-1]["content"]
    if text.startswith(DAPO_PREFIX):
        text = text[len(DAPO_PREFIX):]
    if text.endswith(DAPO_SUFFIX):
        text = text[: -len(DAPO_SUFFIX)]
    return text.strip()


def _gsm8k_answer(row: Mapping[str, Any]) -> str:
    solution = _text(row, "answer")
    if "####" not in solution:
        raise Malformed("field 'answer' has no '#### <final answer>' line")
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise Malformed("field 'answer' has an empty '####' line")
    return final


def _first_text(*paths: str) -> Callable[[Mapping[str, Any]], str]:
    def get(row: Mapping[str, Any]) -> str:
        for p in paths:
            if row.get(p) is not None:
                return _text(row, p)
        raise Malformed(f"missing field '{' or '.join(paths)}'")

    return get


@dataclass(frozen=True)
class Schema:
    """How one published layout maps onto (problem, answer, id, metadata)."""

    name: str
    problem: Callable[[Mapping[str, Any]], str]
    answer: Callable[[Mapping[str, Any]], str]
    id_path: str | None
    metadata: tuple[str, ...] = ()
    formats: tuple[str, ...] = ("boxed",)
    """Answer formats accepted when grading: ours (boxed) plus the dataset's own, if it asks for one."""

    def row(self, record: Any, fallback_id: str) -> MathRow:
        if not isinstance(record, Mapping):
            raise Malformed(f"row is a {type(record).__name__}, expected an object")
        meta = {k: record[k] for k in self.metadata if record.get(k) is not None}
        return MathRow(self.problem(record), self.answer(record), _optional_id(record, self.id_path) or fallback_id,
                       meta)


SCHEMAS: dict[str, Schema] = {
    # BytedTsinghua-SIA/DAPO-Math-17k: prompt=[{role, content}], reward_model.ground_truth, extra_info.index
    "dapo": Schema("dapo", _dapo_problem, lambda r: _answer_text(r, "reward_model.ground_truth"), "extra_info.index",
                   ("data_source",), ("boxed", "answer_line")),
    # HuggingFaceH4/MATH-500
    "math500": Schema("math500", lambda r: _text(r, "problem"), lambda r: _answer_text(r, "answer"), "unique_id",
                      ("subject", "level")),
    # Maxwell-Jia/AIME_2024
    "aime2024": Schema("aime2024", lambda r: _text(r, "Problem"), lambda r: _answer_text(r, "Answer"), "ID"),
    # yentinglin/aime_2025 (id, problem, solution, answer, url, year) and opencompass/AIME2025 (question, answer)
    "aime2025": Schema("aime2025", _first_text("problem", "question"), lambda r: _answer_text(r, "answer"), "id"),
    # AI-MO/aimo-validation-amc
    "amc": Schema("amc", lambda r: _text(r, "problem"), lambda r: _answer_text(r, "answer"), "id", ("url",)),
    # openai/gsm8k: the answer is a worked solution ending in '#### 42'
    "gsm8k": Schema("gsm8k", lambda r: _text(r, "question"), _gsm8k_answer, None, (), ("boxed", "gsm8k")),
}
assert tuple(SCHEMAS) == MATH_FILE_SCHEMAS


def custom_schema(field_map: Mapping[str, str]) -> Schema:
    """A layout given column by column; values may be dotted paths into nested fields."""
    return Schema("custom", lambda r: _text(r, field_map["problem"]), lambda r: _answer_text(r, field_map["answer"]),
                  field_map.get("id"))


def detect_schema(record: Mapping[str, Any]) -> str | None:
    """The published layout whose fields `record` has, or None."""
    keys = set(record)
    if {"prompt", "reward_model"} <= keys:
        return "dapo"
    if {"problem", "unique_id"} <= keys:
        return "math500"
    if {"Problem", "Answer"} <= keys:
        return "aime2024"
    if {"question", "answer"} <= keys and isinstance(record["answer"], str) and "####" in record["answer"]:
        return "gsm8k"
    if {"problem", "answer", "url"} <= keys and not keys & {"solution", "year"}:
        return "amc"  # yentinglin/aime_2025 also has a url, but with a solution and a year
    if ("problem" in keys or "question" in keys) and "answer" in keys:
        return "aime2025"
    return None


# ---- reading files ------------------------------------------------------------------------------------------


def resolve_paths(path: str) -> list[str]:
    """The files `path` names: itself, or every match of a glob. Raises naming the path when there are none."""
    path = os.path.expanduser(path)
    if any(c in path for c in "*?["):
        matches = sorted(p for p in glob.glob(path) if os.path.isfile(p))
        if not matches:
            raise FileNotFoundError(f"task data: no file matches {path!r}")
        return matches
    if not os.path.isfile(path):
        raise FileNotFoundError(f"task data: file {path!r} does not exist")
    return [path]


def read_records(path: str) -> Iterator[tuple[str, int, Any]]:
    """(unit, index, record-or-Malformed) for every row of a .jsonl, .json (array) or .parquet file."""
    if path.endswith(".parquet"):
        yield from _read_parquet(path)
    elif path.endswith(".json"):
        yield from _read_json_array(path)
    else:
        yield from _read_jsonl(path)


def _read_jsonl(path: str) -> Iterator[tuple[str, int, Any]]:
    try:
        f = open(path, "rb")
    except OSError as e:
        raise OSError(f"task data: cannot read {path!r}: {e.strerror}") from e
    with f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                yield "line", lineno, json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield "line", lineno, Malformed(f"invalid UTF-8 at byte {e.start}")
            except json.JSONDecodeError as e:
                yield "line", lineno, Malformed(f"invalid JSON ({e.msg} at column {e.colno})")


def _read_json_array(path: str) -> Iterator[tuple[str, int, Any]]:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise OSError(f"task data: cannot read {path!r}: {e.strerror}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"task data: {path!r} is not a valid JSON file ({e}); use .jsonl for one row per line") from e
    if not isinstance(data, list):
        raise ValueError(f"task data: {path!r} holds a JSON {type(data).__name__}, expected an array of rows")
    for i, record in enumerate(data):
        yield "row", i, record


def _read_parquet(path: str) -> Iterator[tuple[str, int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    index = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield "row", index, record
                index += 1
    except pa.ArrowException as e:  # before OSError: pyarrow's IO errors are both
        raise ValueError(f"task data: {path!r} is not a readable parquet file (after {index} rows): {e}") from e
    except OSError as e:
        raise OSError(f"task data: cannot read {path!r}: {e}") from e


def problem_key(problem: str) -> str:
    # Duplicate problems (DAPO-Math-17k repeats each one many times) must count once and land on one side of the split.
    return " ".join(problem.split()).lower()


class MathFileLoader:
    """Reads problem rows from one path (file or glob), recording every row it had to skip."""

    def __init__(self, path: str, schema: str | None = None, field_map: Mapping[str, str] | None = None) -> None:
        if schema is not None:
            check_choice("schema", schema, MATH_FILE_SCHEMAS)
        self.path = path
        self.schema_name = "custom" if field_map else schema
        self.field_map = dict(field_map or {})
        self.skipped: list[SkippedRow] = []
        self.duplicates = 0
        """Rows dropped because an earlier row had the same problem and answer (counted, logged, not errors)."""

    def _schema(self) -> Schema:
        if self.field_map:
            return custom_schema(self.field_map)
        return SCHEMAS[self.resolve_schema()]

    def _detect(self, path: str) -> str:
        votes: Counter[str] = Counter()
        seen_keys: set[str] = set()
        for _, _, record in _take(read_records(path), 50):
            if isinstance(record, Mapping):
                seen_keys |= set(record)
                name = detect_schema(record)
                if name:
                    votes[name] += 1
        if not votes:
            raise ValueError(f"task data: cannot tell the layout of {path!r} from its fields {sorted(seen_keys)}; "
                             f"set schema (one of {list(MATH_FILE_SCHEMAS)}) or field_map")
        return votes.most_common(1)[0][0]

    def resolve_schema(self) -> str:
        """The layout name ('custom' for a field_map), detected from the first file's first rows if not given."""
        if self.schema_name is None:
            self.schema_name = self._detect(resolve_paths(self.path)[0])
        return self.schema_name

    def load(self) -> list[MathRow]:
        """Every usable row, exact duplicates dropped: the published DAPO-Math-17k parquet repeats each of its
        17k problems about 100 times, and keeping 1.8M copies would cost gigabytes for no information."""
        rows: list[MathRow] = []
        seen: set[tuple[str, str]] = set()
        self.skipped, self.duplicates = [], 0
        schema = self._schema()  # one layout per source: a glob names shards of one dataset
        for path in resolve_paths(self.path):
            stem = os.path.splitext(os.path.basename(path))[0]
            for unit, index, record in read_records(path):
                try:
                    if isinstance(record, Malformed):
                        raise record
                    row = schema.row(record, fallback_id=f"{stem}:{index}")
                except Malformed as e:
                    self._skip(SkippedRow(path, index, unit, str(e)))
                    continue
                key = (problem_key(row.problem), row.answer)
                if key in seen:
                    self.duplicates += 1
                    continue
                seen.add(key)
                rows.append(row)
        if self.duplicates:
            logger.info("task data %s: dropped %d exact duplicate problems", self.path, self.duplicates)
        if self.skipped:
            logger.warning("task data %s: skipped %d malformed rows (first: %s)", self.path, len(self.skipped),
                           self.skipped[0])
        return rows

    def _skip(self, row: SkippedRow) -> None:
        if len(self.skipped) < _LOGGED_SKIPS:
            logger.warning("task data: skipping %s", row)
        self.skipped.append(row)


def _take(it: Iterator[Any], n: int) -> Iterator[Any]:
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x
