"""Tasks: prompts with gold answers, graded completions, and pass@k.

    task = build_task(cfg.task)                      # one source, or a weighted MixtureTask
    batch = itertools.islice(task.samples("train", cfg.task.seed), n)
    with Verifier(task, cfg.task.verifier) as v:     # grading in worker processes, hard time limit
        scores = v.score_batch([(completion, sample), ...])
"""

from asyncrl.tasks.base import REASONS, Sample, Score, Task
from asyncrl.tasks.config import TaskConfig, TaskSourceConfig, VerifierConfig
from asyncrl.tasks.digits import CHARSET as DIGITS_CHARSET, DigitsOptions, DigitsTask
from asyncrl.tasks.extract import AnswerLimits, extract_answer, reject_reason
from asyncrl.tasks.grading import exact_equal, grade, math_equal
from asyncrl.tasks.gym import GymTask
from asyncrl.tasks.math_files import MathFileTask
from asyncrl.tasks.math_loader import MathFileLoader, SkippedRow, detect_schema
from asyncrl.tasks.mixture import MixtureTask
from asyncrl.tasks.passk import pass_at_k, summarize_rewards
from asyncrl.tasks.prompts import PromptFormat
from asyncrl.tasks.registry import build_source, build_task, register_task, registered_tasks
from asyncrl.tasks.verifier import Verifier

__all__ = [
    "REASONS", "Sample", "Score", "Task", "build_source", "build_task", "register_task", "registered_tasks",
    "TaskConfig", "TaskSourceConfig", "VerifierConfig", "DIGITS_CHARSET", "DigitsOptions", "DigitsTask",
    "AnswerLimits", "extract_answer", "reject_reason", "exact_equal", "grade", "math_equal", "GymTask",
    "MathFileLoader", "MathFileTask", "SkippedRow", "detect_schema", "MixtureTask", "pass_at_k",
    "summarize_rewards", "PromptFormat", "Verifier",
]
