"""Tasks: what every environment's task is (prompts with gold answers, graded completions), and the tools to grade
them (answer extraction, math comparison, the sandboxed verifier pool) and to report them (pass@k).

The tasks themselves live with their environments (`asyncrl/envs`, one module each: digits, reasoning_gym,
math_file, lookup, textarena), and a user's in their own package; `asyncrl.envs.build_task` builds a run's.

    with Verifier(task, cfg.task.verifier) as v:     # grading in worker processes, hard time limit
        scores = v.score_batch([(completion, sample), ...])
"""

from asyncrl.tasks.base import REASONS, Sample, Score, Task
from asyncrl.tasks.config import TaskConfig, TaskSourceConfig, VerifierConfig
from asyncrl.tasks.extract import AnswerLimits, extract_answer, reject_reason
from asyncrl.tasks.grading import exact_equal, grade, math_equal
from asyncrl.tasks.mixture import MixtureTask
from asyncrl.tasks.passk import pass_at_k, summarize_rewards
from asyncrl.tasks.prompts import PromptFormat
from asyncrl.tasks.verifier import Verifier

__all__ = [
    "REASONS", "Sample", "Score", "Task", "TaskConfig", "TaskSourceConfig", "VerifierConfig", "AnswerLimits",
    "extract_answer", "reject_reason", "exact_equal", "grade", "math_equal", "MixtureTask", "pass_at_k",
    "summarize_rewards", "PromptFormat", "Verifier",
]
