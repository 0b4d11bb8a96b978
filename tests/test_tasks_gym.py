"""reasoning-gym generators: held-out eval, their own scorers on our extracted answers, and the eval guard."""

import itertools

import pytest

from asyncrl.envs import build_task
from asyncrl.envs.reasoning_gym import GymTask
from asyncrl.tasks import TaskConfig, TaskSourceConfig

DATASETS = ["basic_arithmetic", "chain_sum", "gsm_symbolic", "countdown"]


@pytest.fixture(scope="module", params=DATASETS)
def task(request):
    kwargs = {"min_numbers": 3, "max_numbers": 3} if request.param == "countdown" else {}
    return GymTask(request.param, kwargs, eval_size=8)


def test_correct_and_wrong_answers_use_the_generators_scorer(task):
    for sample in itertools.islice(task.samples("train", seed=3), 3):
        gold = sample.metadata["entry"]["answer"]
        right = task.score(f"<think>\\boxed{{0}}</think> The answer is \\boxed{{{gold}}}", sample)
        assert (right.reward, right.reason) == (1.0, "correct")
        wrong = task.score("\\boxed{123456789}", sample)
        assert wrong.reward < 1.0 and wrong.reason == "wrong"
        assert task.score(f"The answer is {gold}", sample).reason == "no_answer"
        assert task.score(f"<answer>{gold}</answer>", sample).reason == "correct"


def test_eval_is_deterministic_and_held_out(task):
    ev = list(task.samples("eval", seed=3))
    assert len(ev) == 8
    assert [s.prompt for s in ev] == [s.prompt for s in task.samples("eval", seed=3)]
    assert [s.prompt for s in ev] != [s.prompt for s in task.samples("eval", seed=4)]
    train = list(itertools.islice(task.samples("train", seed=3), 40))
    assert not {s.metadata["entry"]["question"] for s in ev} & {s.metadata["entry"]["question"] for s in train}
    assert "\\boxed{}" in ev[0].prompt and ev[0].metadata["task"] == task.dataset


def test_train_skips_questions_that_collide_with_eval():
    # 1-digit sums of two terms: only 100 distinct questions, so different seeds must collide.
    task = GymTask("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, eval_size=30)
    held = {s.metadata["entry"]["question"] for s in task.samples("eval", seed=0)}
    train = [s.metadata["entry"]["question"] for s in itertools.islice(task.samples("train", seed=0), 300)]
    assert len(set(train)) > 20 and not held & set(train)


def test_countdown_scorer_never_sees_python():
    task = GymTask("countdown", {"min_numbers": 3, "max_numbers": 3}, eval_size=1)
    sample = next(task.samples("eval", seed=0))
    for payload in ["__import__('os').system('true')", "9**9**9**9", "open('x').read()", "a+b"]:
        score = task.score(f"\\boxed{{{payload}}}", sample)
        assert (score.reward, score.reason) == (0.0, "rejected")


def test_build_from_config_and_option_errors():
    cfg = TaskConfig(sources=[TaskSourceConfig(environment="reasoning_gym",
                                               options={"dataset": "chain_sum", "max_terms": 3})], eval_size=2)
    task = build_task(cfg)
    assert isinstance(task, GymTask) and task.generator_kwargs == {"max_terms": 3}
    with pytest.raises(ValueError, match=r"task.sources\[0\].options.dataset='string_insertion'"):
        build_task(TaskConfig(sources=[TaskSourceConfig(environment="reasoning_gym",
                                                        options={"dataset": "string_insertion"})]))
    with pytest.raises(ValueError, match=r"task.sources\[0\].options=.*bogus"):
        build_task(TaskConfig(sources=[TaskSourceConfig(environment="reasoning_gym",
                                                        options={"dataset": "chain_sum", "bogus": 1})]))
