"""Task section of the run config: which tasks, mixed how, prompted how, verified how.

YAML presets live in `configs/task/*.yaml` and hold only these fields. Errors name the dotted key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.validate import check, check_choice

# Published dataset layouts that `math_file` recognizes (see math_files.py for the fields of each).
MATH_FILE_SCHEMAS = ("dapo", "math500", "aime2024", "aime2025", "amc", "gsm8k")
# Canonical row fields a `field_map` may point at a file's own column (dotted paths reach nested fields).
FIELD_MAP_KEYS = ("problem", "answer", "id")
SOURCE_SPLITS = ("both", "train", "eval")
PROMPT_TEMPLATES = ("plain", "chat")
VERIFIER_MODES = ("math", "exact")

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class TaskSourceConfig:
    """One task in the mixture.

    Validated by the enclosing `TaskConfig` (which knows this entry's index, so errors read
    `task.sources[2].weight=...`); task-specific `options` are validated when the task is built.
    """

    environment: str = "digits"
    """The environment its samples come from and are played in (its task data and its episodes, together): an import
    path 'package.module:ATTRIBUTE' naming an `asyncrl.envs.EnvironmentSpec` (your own package: it travels to every
    host with the run), or a built-in one: 'digits' (our tiny task), 'reasoning_gym' (generated problems),
    'math_file' (local files), 'lookup' (a two-turn lookup), 'textarena' (text games)."""
    weight: float = 1.0
    """Relative share of training samples drawn from this source (> 0); weights need not sum to 1."""
    path: str | None = None
    """math_file: a .jsonl/.json/.parquet file, or a glob matching several; ignored by generated tasks."""
    schema: str | None = None
    """math_file: dataset layout, one of dapo, math500, aime2024, aime2025, amc, gsm8k; null = detect from fields."""
    field_map: dict[str, str] = field(default_factory=dict)
    """math_file: our field -> the file's column for files in no known layout, e.g. {problem: q, answer: a.final}.
    Keys: problem, answer, id. Setting it overrides `schema`."""
    split: str = "both"
    """Which split this source feeds: 'train', 'eval', or 'both' (then `task.eval_size` items are held out)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Task-specific settings, e.g. digits {op: max, min_digits: 3}, reasoning_gym {dataset: chain_sum, ...}."""
    tools: bool = False
    """Let the model call the run's `tools` (a sandboxed Python) in turns before it answers; the answer is graded as
    without tools. Only for a single-turn environment (a multi-turn one decides its own turns)."""

    def validate(self, where: str) -> None:
        check(f"{where}.environment", self.environment, isinstance(self.environment, str) and bool(self.environment),
              "a built-in environment name or an import path 'package.module:ATTRIBUTE'")
        check(f"{where}.weight", self.weight, self.weight > 0, "> 0")
        check_choice(f"{where}.split", self.split, SOURCE_SPLITS)
        if self.schema is not None:
            check_choice(f"{where}.schema", self.schema, MATH_FILE_SCHEMAS)
        for key, column in self.field_map.items():
            check_choice(f"{where}.field_map", key, FIELD_MAP_KEYS)
            check(f"{where}.field_map.{key}", column, isinstance(column, str) and bool(column), "a column name")
        if self.field_map:
            for key in ("problem", "answer"):
                check(f"{where}.field_map", dict(self.field_map), key in self.field_map,
                      f"a mapping that names '{key}'")


@dataclass(frozen=True)
class VerifierConfig:
    """How completions are graded off the trainer's critical path."""

    mode: str = "math"
    """'math': answers compared as math with math-verify (0.5 == 1/2); 'exact': equal after collapsing whitespace."""
    timeout_s: float = 5.0
    """Hard wall-clock limit per completion: a worker still busy then is killed, the answer scores 0 ('timeout')."""
    workers: int = 2
    """Grading worker processes; 0 grades inline in the caller (no time limit: tests and debugging only)."""
    max_answer_chars: int = 256
    """Extracted answers longer than this are rejected before parsing (reward 0, reason 'rejected')."""
    memory_limit_mb: int = 2048
    """Address space (MiB) a worker may add after start-up; beyond it allocations fail inside the worker (reason
    'error') instead of exhausting the machine. 0 = no cap."""
    max_pending: int = 4096
    """Answers waiting for a worker before `submit` blocks (back-pressure on decode). A submit blocked for
    `submit_timeout_s` fails with an error naming the pool, instead of queueing without bound."""
    submit_timeout_s: float = 300.0
    """Longest `submit` waits for room among the pending answers."""

    def __post_init__(self) -> None:
        check_choice("task.verifier.mode", self.mode, VERIFIER_MODES)
        check("task.verifier.max_pending", self.max_pending, self.max_pending >= 1, ">= 1")
        check("task.verifier.submit_timeout_s", self.submit_timeout_s, self.submit_timeout_s > 0, "> 0")
        check("task.verifier.timeout_s", self.timeout_s, self.timeout_s > 0, "> 0")
        check("task.verifier.workers", self.workers, self.workers >= 0, ">= 0")
        check("task.verifier.max_answer_chars", self.max_answer_chars, self.max_answer_chars > 0, "> 0")
        check("task.verifier.memory_limit_mb", self.memory_limit_mb,
              self.memory_limit_mb == 0 or self.memory_limit_mb >= 256, "0 (no cap) or >= 256")


@dataclass(frozen=True)
class TaskConfig:
    """The task section: a weighted mixture of sources, one prompt template, one verifier."""

    sources: list[TaskSourceConfig] = field(default_factory=lambda: [TaskSourceConfig()])
    """The tasks to train and evaluate on; training interleaves them by weight."""
    prompt_template: str = "plain"
    """'plain': one text prompt; 'chat': a list of messages for the tokenizer's chat template. Digits ignores it."""
    system_prompt: str = ""
    """System message (chat) or preamble (plain); empty for none."""
    instruction: str = DEFAULT_INSTRUCTION
    """Appended after each problem; it tells the model where to put the final answer."""
    eval_size: int = 256
    """Eval samples held out per source whose split is 'both' (generated tasks: generated per seed). A source
    with split 'eval' is evaluated whole."""
    seed: int = 0
    """Seeds the train order and the choice of held-out items; use one seed for both splits."""
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    """Answer grading settings."""

    def __post_init__(self) -> None:
        check("task.sources", list(self.sources), len(self.sources) > 0, "a non-empty list")
        for i, source in enumerate(self.sources):
            source.validate(f"task.sources[{i}]")
        check_choice("task.prompt_template", self.prompt_template, PROMPT_TEMPLATES)
        check("task.eval_size", self.eval_size, self.eval_size >= 0, ">= 0")
        check("task.seed", self.seed, self.seed >= 0, ">= 0")


__all__ = ["TaskConfig", "TaskSourceConfig", "VerifierConfig", "DEFAULT_INSTRUCTION", "MATH_FILE_SCHEMAS"]
