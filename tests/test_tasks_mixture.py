"""Weighted interleaving of sources, eval concatenation, per-source scoring, and a mixture in the worker pool."""

import itertools
import json

import pytest

from asyncrl.envs.digits import DigitsOptions, DigitsTask
from asyncrl.envs.math_file import MathFileTask
from asyncrl.tasks import MixtureTask, Sample, Verifier, VerifierConfig


def _digits(op):
    return DigitsTask(DigitsOptions(op=op), eval_size=5, label=f"digits_{op}")


def test_weights_set_the_share_of_every_window():
    mix = MixtureTask([_digits("max"), _digits("min"), _digits("last")], [0.5, 0.3, 0.2])
    labels = [s.metadata["task"] for s in itertools.islice(mix.samples("train", 0), 1000)]
    assert [labels.count(f"digits_{op}") for op in ("max", "min", "last")] == [500, 300, 200]
    for start in range(0, 1000, 100):
        window = labels[start:start + 10]
        assert window.count("digits_max") == 5 and window.count("digits_min") == 3
    assert labels == [s.metadata["task"] for s in itertools.islice(mix.samples("train", 0), 1000)]


def test_eval_concatenates_sources_and_scoring_dispatches_by_label():
    mix = MixtureTask([_digits("max"), _digits("min")], [1, 1])
    ev = list(mix.samples("eval", 0))
    assert [s.metadata["task"] for s in ev] == ["digits_max"] * 5 + ["digits_min"] * 5
    for s in ev:
        assert mix.score(s.answer, s).reason == "correct"
    digits = [int(c) for c in ev[0].prompt.rstrip(">").split()]
    wrong_rule = str(min(digits))
    assert mix.score(wrong_rule, ev[0]).reason == ("correct" if min(digits) == max(digits) else "wrong")
    with pytest.raises(KeyError, match="digits_first"):
        mix.score("1", Sample("x", "1 2>", "2", {"task": "digits_first"}))


def test_bad_mixtures_are_rejected():
    with pytest.raises(ValueError, match="distinct labels"):
        MixtureTask([_digits("max"), _digits("max")], [1, 1])
    with pytest.raises(ValueError, match="> 0"):
        MixtureTask([_digits("max")], [0])


def test_mixture_grades_in_the_worker_pool(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"problem": f"p{i}", "answer": f"{i}/4", "unique_id": str(i)}) + "\n"
                            for i in range(6)))
    mix = MixtureTask([_digits("max"), MathFileTask(str(path), use="train")], [1, 1])
    train = list(itertools.islice(mix.samples("train", 0), 8))
    items = []
    for s in train:
        if s.metadata["task"] == "digits_max":
            items.append((s.answer, s))
        else:
            items.append((rf"\boxed{{{int(s.answer.split('/')[0]) / 4}}}", s))
    with Verifier(mix, VerifierConfig(workers=1)) as v:
        scores = v.score_batch(items)
    assert [s.reason for s in scores] == ["correct"] * 8
