"""The tiny `digits` task: the rule, the character set, the disjoint split and the reward."""

import itertools

import pytest

from asyncrl.envs import build_task
from asyncrl.envs.digits import CHARSET as DIGITS_CHARSET, OPS, DigitsOptions, DigitsTask
from asyncrl.tasks import TaskConfig, TaskSourceConfig


def _digits(prompt: str) -> list[int]:
    return [int(t) for t in prompt.rstrip(">").split() if t.isdigit()]


@pytest.mark.parametrize("op,rule", [("max", max), ("min", min), ("first", lambda d: d[0]), ("last", lambda d: d[-1]),
                                     ("sum_mod10", lambda d: sum(d) % 10)])
def test_answer_is_the_rule_applied_to_the_prompt(op, rule):
    task = DigitsTask(DigitsOptions(op=op, min_digits=2, max_digits=6))
    for s in itertools.islice(task.samples("train", seed=0), 200):
        assert s.answer == str(rule(_digits(s.prompt)))
        assert 2 <= len(_digits(s.prompt)) <= 6 and s.prompt.endswith(">")


def test_mixed_ops_name_the_rule_with_a_letter():
    task = DigitsTask(DigitsOptions(op="mixed"))
    seen = set()
    for s in itertools.islice(task.samples("train", seed=1), 300):
        letter = s.prompt.split()[0]
        op = {code: name for name, (code, _) in OPS.items()}[letter]
        assert s.metadata["op"] == op and s.answer == str(OPS[op][1](tuple(_digits(s.prompt))))
        seen.add(op)
    assert seen == set(OPS)


def test_every_character_is_in_the_charset():
    task = DigitsTask(DigitsOptions(op="mixed", max_digits=8))
    chars = {c for s in itertools.islice(task.samples("train", seed=0), 500) for c in s.prompt + s.answer}
    assert chars <= set(DIGITS_CHARSET) and len(DIGITS_CHARSET) < 20
    assert all(len(s.answer) == 1 for s in task.samples("eval", seed=0))


def test_train_and_eval_are_disjoint_and_eval_is_deterministic():
    task = DigitsTask(DigitsOptions(min_digits=3, max_digits=4), eval_size=200)
    ev = [s.prompt for s in task.samples("eval", seed=5)]
    assert len(ev) == len(set(ev)) == 200
    assert ev == [s.prompt for s in task.samples("eval", seed=5)]
    assert ev != [s.prompt for s in task.samples("eval", seed=6)]
    train = {s.prompt for s in itertools.islice(task.samples("train", seed=5), 20_000)}
    assert not train & set(ev)
    # The hold-out is a property of the prompt, not of the seed: no seed's train ever shows an eval prompt.
    other_seed_train = {s.prompt for s in itertools.islice(task.samples("train", seed=6), 20_000)}
    all_eval = {s.prompt for seed in range(5) for s in task.samples("eval", seed=seed)}
    assert not other_seed_train & all_eval
    # About eval_fraction of the space is held out.
    share = sum(task.is_eval(" ".join(f"{i:04d}") + ">") for i in range(10_000)) / 10_000
    assert 0.08 < share < 0.12


def test_small_spaces_end_eval_early_instead_of_looping():
    task = DigitsTask(DigitsOptions(min_digits=2, max_digits=2, eval_fraction=0.05), eval_size=500)
    ev = [s.prompt for s in task.samples("eval", seed=0)]
    assert 0 < len(ev) < 20 and all(task.is_eval(p) for p in ev)


def test_reward_is_exact_match_of_the_stripped_completion():
    task = DigitsTask()
    s = next(task.samples("eval", seed=0))
    other = str((int(s.answer) + 1) % 10)
    assert task.score(s.answer, s).reason == "correct"
    assert task.score(f" {s.answer}\n", s).reward == 1.0
    assert task.score(f"{s.answer}{s.answer}", s).reason == "wrong"
    assert task.score(other, s).reason == "wrong"
    assert task.score("  ", s).reason == "no_answer"
    prefix = DigitsTask(DigitsOptions(match="prefix"))
    assert prefix.score(f"{s.answer} trailing", s).reward == 1.0
    assert prefix.score(f"{other}{s.answer}", s).reward == 0.0


def test_build_and_option_errors():
    task = build_task(TaskConfig(sources=[TaskSourceConfig(options={"op": "min", "max_digits": 4})],
                                 eval_size=10))
    assert isinstance(task, DigitsTask) and task.options.op == "min" and len(list(task.samples("eval", 0))) == 10
    with pytest.raises(ValueError, match=r"task.sources\[0\].options.op='median' is invalid"):
        build_task(TaskConfig(sources=[TaskSourceConfig(options={"op": "median"})]))
    with pytest.raises(ValueError, match=r"task.sources\[0\].options.max_digits=2 is invalid"):
        build_task(TaskConfig(sources=[TaskSourceConfig(options={"min_digits": 3, "max_digits": 2})]))
    with pytest.raises(ValueError, match=r"task.sources\[0\].options='colour'"):
        build_task(TaskConfig(sources=[TaskSourceConfig(options={"colour": 1})]))
