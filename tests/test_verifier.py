"""Answer extraction, pre-filters and math/exact comparison (in-process; the worker pool is in test_verifier_pool)."""

import pytest

from asyncrl.tasks.extract import AnswerLimits, extract_answer, final_boxed, last_boxed, reject_reason, strip_thinking
from asyncrl.tasks.grading import exact_equal, grade, math_equal

# ---- extraction ---------------------------------------------------------------------------------------------


def test_last_boxed_takes_the_last_one_and_keeps_nested_braces():
    text = r"first \boxed{1} then \boxed{\frac{\sqrt{2}}{2}} done"
    assert last_boxed(text) == r"\frac{\sqrt{2}}{2}"


def test_fbox_and_space_before_brace():
    assert last_boxed(r"so \fbox{42}") == "42"
    assert last_boxed(r"so \boxed {7}") == "7"


def test_escaped_braces_are_not_groups():
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"


def test_nested_boxes_give_the_innermost_last_opened():
    assert last_boxed(r"\boxed{\boxed{5}}") == "5"


def test_unclosed_last_box_falls_back_to_an_earlier_closed_one():
    assert last_boxed(r"\boxed{3} and then \boxed{4") == "3"
    assert last_boxed(r"\boxed{") is None
    assert last_boxed("no box here") is None


def test_extraction_only_looks_after_the_last_think_close():
    text = r"<think>maybe \boxed{1}</think> hmm <think>\boxed{2}</think> The answer is \boxed{3}."
    assert strip_thinking(text) == r" The answer is \boxed{3}."
    assert extract_answer(text) == "3"
    # An answer that exists only inside the thinking does not count.
    assert extract_answer(r"<think>\boxed{9}</think> I am not sure.") is None


def test_other_answer_formats_in_order():
    assert extract_answer("blah\nAnswer: $\\frac{1}{2}$", ("boxed", "answer_line")) == r"\frac{1}{2}"
    assert extract_answer("so 3+4=7\n#### 7", ("boxed", "gsm8k")) == "7"
    assert extract_answer("<answer> 12 </answer>", ("answer_tag",)) == "12"
    assert extract_answer(r"<answer>x is \boxed{5}</answer>", ("answer_tag",)) == "5"
    # The first format that matches wins, so a boxed answer beats an Answer: line.
    assert extract_answer("\\boxed{2}\nAnswer: 3", ("boxed", "answer_line")) == "2"
    assert extract_answer("Answer: 3", ("boxed",)) is None
    assert extract_answer("So the final answer is $-3$. I hope it is correct.", ("final_answer",)) == "-3"
    assert extract_answer("The final answer is: 3.5\nok", ("final_answer",)) == "3.5"
    assert extract_answer("final answer is 2. No wait, the final answer is 4.", ("final_answer",)) == "4"
    assert extract_answer("The answer is 4.", ("final_answer",)) is None
    assert extract_answer("The final answer is $\\boxed{5}$. I hope", ("final_answer",)) == "5"
    with pytest.raises(ValueError, match="unknown"):
        extract_answer("x", ("nope",))


def test_cleanup_of_dollars_and_trailing_period():
    assert extract_answer("Answer: $42$.", ("answer_line",)) == "42"
    assert extract_answer("Answer: $1$ and $2$", ("answer_line",)) == "$1$ and $2$"


# ---- pre-filters --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", [
    r"\frac{\sqrt{3}}{2}", r"\left(1, \frac{\pi}{2}\right)", "2^{10}", r"\{1,2,3\}", "100!", "10^{100}",
    r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", "x^2+y^2",
])
def test_prefilter_admits_ordinary_answers(answer):
    assert reject_reason(answer) is None


@pytest.mark.parametrize("answer,why", [
    ("9^{9^{9^{9}}}", "power tower"),
    ("2^{99999}", "exponent"),
    ("(x+1)^{9999}", "exponent"),
    ("1" * 300, "longer"),
    ("{" * 10 + "1" + "}" * 10, "nested"),
    (r"\def\a{\a\a}\a", "macros"),
    (r"\newcommand{\x}{1}\x", "macros"),
    ("9**9**9", "**"),
    ("123456!", "factorial"),
])
def test_prefilter_rejects_hostile_answers(answer, why):
    reason = reject_reason(answer)
    assert reason is not None and why in reason


def test_prefilter_limits_are_configurable():
    assert reject_reason("1" * 300, AnswerLimits(max_chars=400)) is None


# ---- comparison ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pred,gold", [
    ("0.5", r"\frac{1}{2}"),
    ("1/2", "0.5"),
    (r"\frac{\sqrt2}{2}", r"\sqrt{2}/2"),
    (r"\dfrac{3}{4}", "0.75"),
    ("1,234", "1234"),
    ("72.0", "72"),
    (r"\{2,1\}", r"\{1,2\}"),
    ("1+x^2", "x^2+1"),
    ("[1,2)", "[1, 2)"),
    (r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}"),
])
def test_math_equivalences(pred, gold):
    assert math_equal(pred, gold)


@pytest.mark.parametrize("pred,gold", [
    ("3", "4"), (r"\frac{1}{3}", "0.5"), ("x+1", "x-1"), ("[1,2)", "(1,2)"), (r"\pi", "3.14"),
])
def test_math_differences(pred, gold):
    assert not math_equal(pred, gold)


def test_python_in_an_answer_is_never_evaluated(tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    for text in (rf"\boxed{{{payload}}}", f"Answer: {payload}", f"#### {payload}"):
        s = grade(text, "0", formats=("boxed", "answer_line", "gsm8k"))
        assert s.reward == 0.0
    assert not marker.exists()


def test_exact_mode_normalizes_whitespace_only():
    assert exact_equal("  a   b\n c ", "a b c")
    assert not exact_equal("0.5", "1/2")
    assert grade(r"\boxed{ x  y }", "x y", mode="exact").reason == "correct"
    assert grade(r"\boxed{0.5}", r"\frac{1}{2}", mode="exact").reason == "wrong"
    assert grade(r"\boxed{0.5}", r"\frac{1}{2}", mode="math").reason == "correct"


def test_grade_reasons():
    assert grade(r"<think>\boxed{2}</think>the answer is \boxed{2}", "2").reason == "correct"
    assert grade("I give up", "2").reason == "no_answer"
    s = grade(r"\boxed{9^{9^{9^{9}}}}", "2")
    assert (s.reward, s.reason, s.extracted) == (0.0, "rejected", "9^{9^{9^{9}}}")
    assert grade(r"\boxed{3}", "2").reason == "wrong"


def test_gold_in_dollars_is_compared_as_math():
    assert grade(r"\boxed{244/607}", "$244/607$").reason == "correct"


# ---- several boxes: one answer, graded as a set -------------------------------------------------------------
# The rule, from math-verify's documentation: latex2sympy2_extended's `extract_boxed_content` extracts several
# boxes together when the text between two is under 10 characters, or under 70 with a separator (and, or, a comma,
# a semicolon) and different contents; math_verify's `extract_latex` then wraps several expressions in one
# FiniteSet ("to handle solution is: 1,2 and 3"). Each case states the expected grade, and math_verify's own
# verdict on the raw completion (the gold as a box's content, as our grader reads gold) must agree with it.
LONG = " and the rest of a long derivation that is certainly longer than seventy characters in total, "
MULTI_BOX = [
    (r"The roots are $\boxed{2}$ and $\boxed{3}$.", "2, 3", True),
    (r"The roots are $\boxed{2}$ and $\boxed{3}$.", "3, 2", True),  # a set: order is free
    (r"The roots are $\boxed{2}$ and $\boxed{3}$.", "2", False),  # one root is not the answer
    (r"The roots are $\boxed{2}$ and $\boxed{3}$.", "3", False),  # not even the last one
    (r"$x = \boxed{-1}$ or $x = \boxed{4}$", "-1, 4", True),
    (r"\boxed{1}, \boxed{2}, \boxed{3}", r"\{1, 2, 3\}", True),
    (r"\boxed{\frac{1}{2}}; \boxed{0.75}", r"\frac{3}{4}, 0.5", True),  # each element compared as math
    (r"\boxed{1} \boxed{2}", "1, 2", True),  # near: no separator needed
    (r"We get \boxed{5}, which then gives (after a little more algebra) \boxed{7}", "5, 7", True),
    (r"We get \boxed{5} which then gives (after a little more algebra) \boxed{7}", "7", True),  # no separator
    (r"A first guess \boxed{5}" + LONG + r"so finally \boxed{7}", "7", True),  # far apart: only the last
    (r"A first guess \boxed{5}" + LONG + r"so finally \boxed{7}", "5, 7", False),
    (r"\boxed{2}, \boxed{2}", "2", True),  # a repeated box is one answer
]


@pytest.mark.parametrize("completion,gold,correct", MULTI_BOX)
def test_several_boxes_are_graded_as_a_set_as_math_verify_does(completion, gold, correct):
    from math_verify import parse, verify

    assert grade(completion, gold).reward == float(correct)
    assert bool(verify(parse("\\boxed{" + gold + "}"), parse(completion))) == correct


def test_single_box_extraction_is_unchanged():
    for text in (r"so \boxed{42}.", r"\boxed{\{1, 2\}}", r"\boxed{\boxed{5}}", r"\boxed{3} and then \boxed{4",
                 r"first \boxed{1}" + LONG + r"then \boxed{\frac{\sqrt{2}}{2}} done"):
        assert extract_answer(text) == last_boxed(text)
    assert final_boxed(r"x \boxed{1} and \boxed{2}") == ["1", "2"]


def test_box_grouping_is_linear_in_the_text(monkeypatch):
    """Grouping steps back once per box, each step a binary search: the work is counted, not timed (a quadratic
    walk rescanned the text from every box)."""
    import bisect

    from asyncrl.tasks import extract

    steps, bisect_left = [], bisect.bisect_left
    monkeypatch.setattr(extract.bisect, "bisect_left", lambda a, x: (steps.append(x), bisect_left(a, x))[1])
    for n in (1_000, 20_000):
        steps.clear()
        text = (r"\boxed{1}, " * n) + "end"
        assert len(final_boxed(text)) == 1  # equal contents collapse into one
        assert len(steps) == n  # one step back per box: the last box's n - 1 predecessors, then the stop
