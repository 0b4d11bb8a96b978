"""Compare an extracted answer with the gold one: as mathematics (math-verify) or as exact text.

These functions have no time limit of their own; `Verifier` runs them in worker processes that are killed
when they overrun. Model text is only ever handed to math-verify's LaTeX grammar (an ANTLR parser); its
plain-expression path calls sympy's `parse_expr`, which evaluates Python, so it is never enabled here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from asyncrl.tasks.base import Score
from asyncrl.tasks.extract import AnswerLimits, clean_answer, extract_answer, reject_reason

SHOWN_CHARS = 200  # how much of an extracted answer a Score keeps for logs


def normalize_exact(text: str) -> str:
    return " ".join(text.split())


def exact_equal(pred: str, gold: str) -> bool:
    """Equal after collapsing every run of whitespace and trimming the ends."""
    return normalize_exact(pred) == normalize_exact(gold)


@functools.cache
def _math_verify() -> tuple[Any, Any, Any]:
    import math_verify
    import math_verify.grader
    import math_verify.parser

    # We pass timeout=None (signal-based timeouts break off the main thread and would cancel the worker's
    # own alarm); the time bound is the Verifier's. Silence the warning that says we must provide one.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    extraction = [math_verify.LatexExtractionConfig(boxed_match_priority=0)]
    return math_verify.parse, math_verify.verify, extraction


def _parse_latex(latex: str) -> list:
    parse, _, extraction = _math_verify()
    # Re-boxing makes the extractor take exactly this string instead of searching it for candidates.
    return parse("\\boxed{" + latex + "}", extraction_config=extraction, parsing_timeout=None)


@functools.lru_cache(maxsize=8192)
def _parse_gold(gold: str) -> tuple:
    # Gold answers repeat across a group of samples; they are trusted data, so caching them is safe.
    return tuple(_parse_latex(clean_answer(gold)))


def math_equal(pred: str, gold: str) -> bool:
    """True when `pred` and `gold` denote the same mathematical object (0.5 == 1/2, sqrt2/2 == 1/sqrt2)."""
    _, verify, _ = _math_verify()
    gold_parsed = _parse_gold(gold)
    pred_parsed = _parse_latex(pred)
    if not gold_parsed or not pred_parsed:
        return exact_equal(pred, clean_answer(gold))
    return bool(verify(list(gold_parsed), pred_parsed, timeout_seconds=None))


def warmup_math() -> None:
    """Import math-verify and its ANTLR grammar now rather than inside the first timed answer."""
    math_equal("\\frac{1}{2}", "0.5")


def grade(completion: str, gold: str, mode: str = "math", formats: Sequence[str] = ("boxed",),
          limits: AnswerLimits = AnswerLimits()) -> Score:
    """Extract the final answer from `completion` and compare it with `gold` (mode 'math' or 'exact')."""
    answer = extract_answer(completion, formats)
    if answer is None:
        return Score(0.0, "no_answer")
    shown = answer[:SHOWN_CHARS]
    if mode == "exact":
        ok = exact_equal(answer, gold)
    elif mode == "math":
        if reject_reason(answer, limits) is not None:
            return Score(0.0, "rejected", shown)
        ok = math_equal(answer, gold)
    else:
        raise ValueError(f"task.verifier.mode={mode!r} is invalid: must be one of ['math', 'exact']")
    return Score(1.0 if ok else 0.0, "correct" if ok else "wrong", shown)
