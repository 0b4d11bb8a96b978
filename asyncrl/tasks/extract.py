"""Find the final answer in a completion, and refuse answers too hostile to hand to a parser.

Everything here is linear in the completion's length (regex scans and one pass over brace tokens), so even a
1 MB completion of nested `\\boxed{` costs well under a second; the verifier's hard time limit is the backstop.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

ANSWER_FORMATS = ("boxed", "answer_tag", "answer_line", "gsm8k", "final_answer")
"""boxed: last `\\boxed{..}`/`\\fbox{..}`, or the final run of several, graded as a set (`final_boxed`);
answer_tag: last `<answer>..</answer>`; answer_line: last `Answer: ..` line (DAPO's format); gsm8k: text after the
last `####`; final_answer: the last "the final answer is X" up to the end of its sentence (Minerva's format, and
what small instruct models say when they skip the box)."""

_THINK_CLOSE = "</think>"
_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A box opener, any escaped character (so `\{` is not a group), or a bare brace.
_BRACE_TOKEN = re.compile(r"\\(?:boxed|fbox)\s*\{|\\.|[{}]", re.DOTALL)
# Greedy `(.*)` then strip in Python: a lazy group followed by `[ \t]*$` is quadratic on long runs of spaces.
_ANSWER_LINE = re.compile(r"^[ \t*#]*answer[ \t*]*:(.*)$", re.IGNORECASE | re.MULTILINE)
# Only the phrase: the answer is the rest of its line, cut at the sentence end (". ") in Python, so that a
# later phrase on the same line is still found and the scan stays linear.
_FINAL_ANSWER = re.compile(r"final answer is\b", re.IGNORECASE)


def strip_thinking(text: str) -> str:
    """The text after the last `</think>`, or all of it when the model did not think out loud."""
    cut = text.rfind(_THINK_CLOSE)
    return text[cut + len(_THINK_CLOSE):] if cut >= 0 else text


def last_boxed(text: str) -> str | None:
    """Content of the last-opened `\\boxed{...}` or `\\fbox{...}` that is closed, nested braces included."""
    first = _BOX_START.search(text)
    if first is None:
        return None
    stack: list[int] = []  # per open brace: where its box content starts, or -1 for a plain group
    best_start, best_end = -1, -1
    for m in _BRACE_TOKEN.finditer(text, first.start()):
        tok = m.group()
        if tok == "{":
            stack.append(-1)
        elif tok == "}":
            if stack:
                start = stack.pop()
                if start > best_start:
                    best_start, best_end = start, m.start()
        elif len(tok) > 2:
            stack.append(m.end())
    return text[best_start:best_end] if best_start >= 0 else None


# Several boxes form one answer when the text between two of them is short, or a little longer but holding a
# separator and the two contents differ: math-verify's rule (latex2sympy2_extended's `extract_boxed_content`,
# whose docstring says that multiple boxes separated by a valid separator are extracted together), which then
# parses them as one set. E.g. "the roots are \boxed{2} and \boxed{3}" answers {2, 3}.
_BOX_SEPARATOR = re.compile(r"\b(?:and|or)\b|,|;")
_NEAR, _FAR = 10, 70


def _closed_boxes(text: str) -> list[tuple[int, int, int]]:
    """(command start, content start, content end) of every closed box, in the order they close."""
    first = _BOX_START.search(text)
    if first is None:
        return []
    stack: list[tuple[int, int] | None] = []  # per open brace: (command start, content start) of a box, or None
    boxes = []
    for m in _BRACE_TOKEN.finditer(text, first.start()):
        tok = m.group()
        if tok == "{":
            stack.append(None)
        elif tok == "}":
            top = stack.pop() if stack else None
            if top is not None:
                boxes.append((top[0], top[1], m.start()))
        elif len(tok) > 2:
            stack.append((m.start(), m.end()))
    return boxes


def final_boxed(text: str) -> list[str]:
    """Contents of the final answer's boxes, left to right: the last-opened closed box (`last_boxed`) and the
    boxes before it that the separator rule above joins to it; consecutive repeats are dropped. Empty when no
    box is closed. Linear in the text: each step back is a binary search over the boxes' closing positions."""
    boxes = _closed_boxes(text)
    if not boxes:
        return []
    ends = [end for _, _, end in boxes]  # ascending: boxes are listed as they close
    cur = max(boxes, key=lambda b: b[1])
    group = [text[cur[1]:cur[2]]]
    while True:
        i = bisect.bisect_left(ends, cur[0]) - 1  # the box that closed last before `cur` opened
        if i < 0 or cur[0] - ends[i] - 1 >= _FAR:
            break
        prev = boxes[i]
        between, content = text[prev[2] + 1:cur[0]], text[prev[1]:prev[2]]
        if not (len(between) < _NEAR or (content.strip() != group[-1].strip() and _BOX_SEPARATOR.search(between))):
            break
        if content.strip() != group[-1].strip():
            group.append(content)
        cur = prev
    return group[::-1]


def _boxed(text: str) -> str | None:
    """The final answer's boxes; several are joined with commas, which math-verify reads as a set."""
    group = final_boxed(text)
    if not group:
        return None
    return group[0] if len(group) == 1 else ", ".join(g.strip() for g in group)


def _answer_tag(text: str) -> str | None:
    close = text.rfind("</answer>")
    if close < 0:
        return None
    open_ = text.rfind("<answer>", 0, close)
    if open_ < 0:
        return None
    inner = text[open_ + len("<answer>"):close]
    boxed = _boxed(inner)
    return boxed if boxed is not None else inner


def _answer_line(text: str) -> str | None:
    last = None
    for match in _ANSWER_LINE.finditer(text):  # the last one
        last = match
    return last.group(1) if last is not None else None


def _final_answer(text: str) -> str | None:
    last = None
    for match in _FINAL_ANSWER.finditer(text):  # the last one
        last = match
    if last is None:
        return None
    end = text.find("\n", last.end())
    sentence = text[last.end():end if end >= 0 else len(text)].lstrip(" \t:")
    cut = sentence.find(". ")
    sentence = sentence[:cut] if cut >= 0 else sentence
    boxed = _boxed(sentence)  # "The final answer is $\\boxed{5}$."
    return boxed if boxed is not None else sentence


def _gsm8k(text: str) -> str | None:
    cut = text.rfind("####")
    if cut < 0:
        return None
    return text[cut + 4:].lstrip().split("\n", 1)[0]


_EXTRACTORS = {"boxed": _boxed, "answer_tag": _answer_tag, "answer_line": _answer_line, "gsm8k": _gsm8k,
               "final_answer": _final_answer}


def _drop_period(answer: str) -> str:
    return answer[:-1].rstrip() if answer.endswith(".") and not answer.endswith("..") else answer


def clean_answer(answer: str) -> str:
    """Drop the wrapping a model commonly puts around a final answer: `$..$`, a trailing period, spaces."""
    answer = _drop_period(answer.strip())
    # Count, then slice once: peeling one `$` per iteration is quadratic on a megabyte of dollars.
    k = min(len(answer) - len(answer.lstrip("$")), len(answer) - len(answer.rstrip("$")))
    if 0 < k and 2 * k <= len(answer) and "$" not in answer[k:len(answer) - k]:
        answer = _drop_period(answer[k:len(answer) - k].strip())
    return answer


_RENDER = {"boxed": "\\boxed{{{}}}", "answer_tag": "<answer>{}</answer>", "answer_line": "Answer: {}",
           "gsm8k": "#### {}", "final_answer": "The final answer is {}."}


def render_answer(answer: str, fmt: str) -> str:
    """`answer` stated in format `fmt`, so that `extract_answer(render_answer(a, f), (f,)) == a`."""
    if fmt not in _RENDER:
        raise ValueError(f"answer format {fmt!r} is unknown; allowed: {list(ANSWER_FORMATS)}")
    return _RENDER[fmt].format(answer)


def extract_answer(completion: str, formats: Sequence[str] = ("boxed",)) -> str | None:
    """The final answer in the first of `formats` that matches, looking only after the last `</think>`."""
    text = strip_thinking(completion)
    for fmt in formats:
        if fmt not in _EXTRACTORS:
            raise ValueError(f"answer format {fmt!r} is unknown; allowed: {list(ANSWER_FORMATS)}")
        found = _EXTRACTORS[fmt](text)
        if found is not None:
            found = clean_answer(found)
            if found:
                return found
    return None


# ---- pre-filters --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnswerLimits:
    """Bounds past which an answer is refused before parsing. Measured here with math-verify 0.9: ANTLR parse
    time grows steeply with nesting (8 nested parentheses already take ~0.7 s), sympy hangs on power towers
    and on symbolic powers with 4-digit exponents, and `\\def` is never needed in an answer."""

    max_chars: int = 256
    max_depth: int = 6
    max_exponent_digits: int = 3
    max_factorial_digits: int = 3


_MACROS = re.compile(r"\\(?:def|edef|gdef|xdef|let|newcommand|renewcommand|providecommand|DeclareMathOperator"
                     r"|catcode|csname|expandafter|input|include|write|read|openin|openout|immediate)(?![a-zA-Z])")
_DIGITS = re.compile(r"\d+")
_FACTORIAL = re.compile(r"(\d+)\s*!")
_BINOM = re.compile(r"\\[dt]?binom(?![a-zA-Z])")


def _operand_at(s: str, i: int) -> tuple[str, int]:
    """(operand, end) for the operand starting at `s[i]`: a balanced `{...}` group, a `\\command`, or one char."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return "", i
    if s[i] == "{":
        depth = 0
        for j in range(i, len(s)):
            if s[j] == "{" and s[j - 1] != "\\":
                depth += 1
            elif s[j] == "}" and s[j - 1] != "\\":
                depth -= 1
                if depth == 0:
                    return s[i + 1:j], j + 1
        return s[i + 1:], len(s)
    if s[i] == "\\":
        m = re.match(r"\\[a-zA-Z]+", s[i:])
        n = len(m.group()) if m else 2
        return s[i:i + n], i + n
    return s[i], i + 1


def reject_reason(answer: str, limits: AnswerLimits = AnswerLimits()) -> str | None:
    """Why `answer` must not be parsed, or None when it may be. Cheap: O(len) on a string of bounded length."""
    if len(answer) > limits.max_chars:
        return f"longer than {limits.max_chars} chars"
    # Escaped `\{` counts too: nested sets are as costly to parse as nested groups.
    depth = 0
    for ch in answer:
        if ch in "{([":
            depth += 1
            if depth > limits.max_depth:
                return f"nested deeper than {limits.max_depth}"
        elif ch in "})]":
            depth = max(0, depth - 1)
    if _MACROS.search(answer):
        return "defines or expands macros"
    if "**" in answer:
        return "uses ** (not LaTeX)"
    for i, ch in enumerate(answer):
        if ch == "^":
            operand, end = _operand_at(answer, i + 1)
            # `a^{b^c}` and the unbraced chain `a^b^c` are both towers; sympy evaluates them eagerly.
            if "^" in operand or "\\exp" in operand or answer[end:].lstrip().startswith("^"):
                return "power tower"
            if any(len(d) > limits.max_exponent_digits for d in _DIGITS.findall(operand)):
                return f"exponent with more than {limits.max_exponent_digits} digits"
    for m in _BINOM.finditer(answer):
        first, end = _operand_at(answer, m.end())
        second, _ = _operand_at(answer, end)
        for arg in (first, second):
            if "^" in arg or any(len(d) > limits.max_factorial_digits for d in _DIGITS.findall(arg)):
                return f"binomial of a number with more than {limits.max_factorial_digits} digits"
    for m in _FACTORIAL.finditer(answer):
        if len(m.group(1).lstrip("0")) > limits.max_factorial_digits:
            return f"factorial of a number with more than {limits.max_factorial_digits} digits"
    return None
