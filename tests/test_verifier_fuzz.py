"""Hostile completions through the real worker pool: every one scores 0, none escapes, the batch stays bounded.

Gold answers are chosen so that no completion below can be right, so any reward > 0 is a verifier bug.
"""

import json
import os
import random
import time

import pytest

from asyncrl.envs.math_file import MathFileTask
from asyncrl.tasks import Sample, Verifier, VerifierConfig
from asyncrl.tasks.extract import ANSWER_FORMATS

GOLDS = [r"\frac{31337}{7919}", r"\sqrt{7919}+\frac{1}{31337}"]
MB = 1 << 20
INJECTIONS = [
    "__import__('os').system('touch {marker}')",
    "eval(\"__import__('os').system('touch {marker}')\")",
    "exec('open(\"{marker}\", \"w\")')",
    "().__class__.__bases__[0].__subclasses__()",
    "lambda: open('{marker}', 'w')",
    "import os; os.system('touch {marker}')",
]
LATEX_TOKENS = [r"\frac{", "}{", "}", "{", "^", "_", r"\sqrt{", "+", "-", r"\cdot", r"\left(", r"\right)", "(", ")",
                "x", "y", r"\pi", r"\infty", "=", ",", "0", "1", "2", "3", "7", "9", r"\{", r"\}", "[", "]", r"\ln",
                r"\sin", "!", "%", r"\%", "&", r"\\", r"\text{", r"\mathrm{", r"\binom{", r"\sum_{", r"\prod_{", "i",
                r"\le", r"\cup", r"\emptyset", r"\mathbb{R}", r"\begin{pmatrix}", r"\end{pmatrix}"]


def _wrap(body: str, rng: random.Random) -> str:
    style = rng.randrange(6)
    if style == 0:
        return rf"Let me think. \boxed{{{body}}}"
    if style == 1:
        return f"<think>{rng.random()}</think>\nAnswer: {body}"
    if style == 2:
        return f"work...\n#### {body}"
    if style == 3:
        return f"<answer>{body}</answer>"
    if style == 4:
        return f"So the final answer is {body}. I hope it is correct."
    return rf"\fbox{{{body}}}"


def hostile_corpus(n: int, marker: str, seed: int = 0) -> list[str]:
    """About `n` hostile completions, a fixed mix of families (deterministic for `seed`)."""
    rng = random.Random(seed)
    out: list[str] = []
    per = max(1, n // 20)
    for d in (7, 10, 40, 1000, 10_000):  # deep braces, and \boxed nested 10k deep, closed and unclosed
        out += [r"\boxed{" + "{" * d + "1" + "}" * d + "}", r"\boxed{" * d + "1" + "}" * d, r"\boxed{" * d + "1",
                r"\boxed{" + "(" * d + "1" + ")" * d + "}", r"\boxed{" + r"\left(" * d + "1" + r"\right)" * d + "}"]
    for tower in (r"9^{9^{9^{9}}}", r"10^{10^{10}}", r"2^{99999999}", r"(x+1)^{99999}", "9^9^9^9", r"e^{e^{e^{99}}}",
                  r"99999999999^{99999999}", r"\left(9^{9}\right)^{9^{9}}", "1000000!", r"10^{10^{6}}",
                  r"\binom{10^{6}}{500000}", r"\prod_{k=1}^{99999999} k", r"\sum_{n=1}^{10^{9}} n^{2}", "9**9**9**9"):
        out += [_wrap(tower, rng) for _ in range(per // 4 + 1)]
    for inj in INJECTIONS:
        out += [_wrap(inj.format(marker=marker), rng) for _ in range(per // 2 + 1)]
    out += [
        "a" * MB, "{" * MB, r"\boxed{" + "1" * MB + "}", "$" * MB, "Answer: " + " " * MB + "x", r"\boxed{" * (MB // 8),
        "#### " + "9" * MB, "<answer>" + "(" * MB + "</answer>", "</think>" * (MB // 8), "Answer:" + "\n" * MB,
        "final answer is " * (MB // 16), "The final answer is " + " " * MB + "x", "final answer is: " + ". " * MB,
    ]
    for _ in range(per * 2):  # invalid UTF-8 decoded the two ways a sampler might
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        text = raw.decode("utf-8", errors=rng.choice(["surrogateescape", "replace"]))
        out.append(_wrap(text, rng) if rng.random() < 0.7 else text)
    for k in (10, 50, 200, 2000):  # LaTeX bombs
        out += [_wrap(r"\frac" * k + "{1}{2}" * k, rng), _wrap(r"\frac{" * k + "1" + "}{2}" * k, rng),
                _wrap(r"\sqrt" * k + "{2}", rng), _wrap("x^" * k + "2", rng), _wrap(r"\sqrt{" * k + "2" + "}" * k, rng),
                _wrap("&".join(["1"] * k), rng), _wrap(r"\begin{pmatrix}" + r"1 & 2 \\" * k + r"\end{pmatrix}", rng)]
    for macro in (r"\def\a{\a\a}\a", r"\def\x{\x\x\x\x}\x\x", r"\newcommand{\b}{\b\b}\b", r"\let\x\relax\x",
                  r"\catcode`\{=12 \x", r"\csname relax\endcsname", r"\input{/etc/passwd}", r"\expandafter\x\x"):
        out += [_wrap(macro, rng) for _ in range(per // 4 + 1)]
    while len(out) < n:  # random token soup: ordinary-looking, parser-exercising, never the gold
        body = "".join(rng.choice(LATEX_TOKENS) for _ in range(rng.randrange(1, 40)))
        out.append(_wrap(body, rng) if rng.random() < 0.9 else body)
    rng.shuffle(out)
    return out


@pytest.fixture(scope="module")
def fuzz_task(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "gold.jsonl"
    with open(path, "w") as f:
        for i, gold in enumerate(GOLDS):
            f.write(json.dumps({"problem": f"p{i}", "answer": gold, "unique_id": f"u{i}"}) + "\n")
    # Every answer format on, so each hostile string reaches every extractor.
    return MathFileTask(str(path), schema="math500", formats=ANSWER_FORMATS)


def _run_fuzz(task, n, workers, timeout_s, tmp_path):
    marker = str(tmp_path / "pwned")
    corpus = hostile_corpus(n, marker)
    samples = [Sample(f"s{i}", "p", GOLDS[i % len(GOLDS)], {"task": "math500"}) for i in range(len(corpus))]
    t0 = time.monotonic()
    with Verifier(task, VerifierConfig(workers=workers, timeout_s=timeout_s)) as v:
        scores = v.score_batch(list(zip(corpus, samples)))
        stats = dict(v.stats)
    elapsed = time.monotonic() - t0
    assert len(scores) == len(corpus)
    bad = [(i, s) for i, s in enumerate(scores) if s.reward != 0.0]
    assert not bad, f"hostile completions scored > 0: {[(corpus[i][:80], s) for i, s in bad[:5]]}"
    assert not os.path.exists(marker), "a completion was executed"
    return scores, stats, elapsed


def test_fuzz_2000_hostile_completions_score_zero_within_bound(fuzz_task, tmp_path):
    # Bound: 2000 answers on 2 workers sharing a loaded 2-core machine, including worker start-up and any
    # kill-and-respawn; measured around 10 s here.
    scores, stats, elapsed = _run_fuzz(fuzz_task, 2000, workers=2, timeout_s=2.0, tmp_path=tmp_path)
    reasons = {r: sum(s.reason == r for s in scores) for r in {s.reason for s in scores}}
    assert reasons.get("rejected", 0) > 50 and reasons.get("no_answer", 0) > 10, reasons
    assert elapsed < 30.0, f"fuzz batch took {elapsed:.1f}s (reasons {reasons}, stats {stats})"


@pytest.mark.slow
def test_fuzz_20000_hostile_completions(fuzz_task, tmp_path):
    _, stats, elapsed = _run_fuzz(fuzz_task, 20_000, workers=2, timeout_s=2.0, tmp_path=tmp_path)
    assert elapsed < 300.0, f"took {elapsed:.1f}s, stats {stats}"
