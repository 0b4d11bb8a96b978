"""Format warm-start data: the targets are answers written in the task's own format, drawn independently of the
prompt, and the task's scorer reads them back."""

import itertools

from asyncrl.envs.digits import DigitsTask
from asyncrl.envs.reasoning_gym import GymTask
from asyncrl.models.tokenizer import Tokenizer, build_char_tokenizer
from asyncrl.tasks.extract import ANSWER_FORMATS, extract_answer, render_answer
from asyncrl.tasks.mixture import MixtureTask
from asyncrl.train.warmstart import _examples


def test_render_answer_round_trips_through_every_format():
    for fmt in ANSWER_FORMATS:
        for answer in ("42", "-3", r"\frac{1}{2}", "3.5"):
            assert extract_answer("Some reasoning.\n" + render_answer(answer, fmt), (fmt,)) == answer, fmt


def test_targets_are_in_the_tasks_format_and_independent_of_the_prompt(tmp_path):
    tok = Tokenizer.from_folder(build_char_tokenizer(str(tmp_path / "tok")))
    gym = GymTask("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "max_digits": 1}, eval_size=4,
                  formats=("boxed", "final_answer"))
    samples = list(itertools.islice(gym.samples("train", 0), 64))
    examples = _examples(gym, tok, 64, seed=0, chat=True)
    completions = [[t for t, m in zip(ids, mask) if m] for ids, mask in examples]
    assert all(ids[: mask.index(1)] == tok.encode_prompt(s.prompt, chat=True)
               for (ids, mask), s in zip(examples, samples))
    targets = [tok.decode(c[:-1]) for c in completions]
    assert all(c[-1] == tok.eos_id for c in completions)
    assert all(t.startswith("\\boxed{") and t.endswith("}") for t in targets)
    golds = {s.answer for s in samples}
    assert {t[len("\\boxed{"):-1] for t in targets} <= golds
    # Drawn independently of the prompt: most targets are not the prompt's own answer.
    assert sum(t == f"\\boxed{{{s.answer}}}" for t, s in zip(targets, samples)) < len(samples) // 2
    # And the scorer reads every target: a target that happens to be the gold answer scores as correct.
    for s in samples[:8]:
        assert gym.score(gym.render_answer(s.answer, s), s).reason == "correct"
    # The digits task states a bare digit; a mixture renders each sample in its own source's format.
    digits = DigitsTask(eval_size=4)
    mix = MixtureTask([digits, gym], [1.0, 1.0])
    for s in itertools.islice(mix.samples("train", 0), 16):
        rendered = mix.render_answer(s.answer, s)
        assert rendered == (s.answer if s.metadata["task"] == "digits" else f"\\boxed{{{s.answer}}}")
        assert mix.score(rendered, s).reason == "correct"


def test_the_cache_is_written_by_process_0_alone_and_an_incomplete_folder_is_recomputed(tmp_path, monkeypatch):
    """A second trainer host (jax process 1) writes no files (save_pretrained), so it must not rename its empty
    temp dir into the cache: that left an empty folder that every later run read as a cached warm-start."""
    import os

    import jax
    import numpy as np

    from asyncrl.models import Model, preset
    from asyncrl.train import warmstart

    tok = Tokenizer.from_folder(build_char_tokenizer(str(tmp_path / "tok")))
    model = Model(preset("tiny"))
    params = model.init_params(jax.random.PRNGKey(0))
    task, cache = DigitsTask(eval_size=4), str(tmp_path / "cache")
    run = lambda: warmstart.cached_format_warmstart(model, params, tok, task, "digits", 2, cache, 0, batch=8)

    monkeypatch.setattr(warmstart.jax, "process_index", lambda: 1)
    second = run()
    assert not os.path.exists(cache) or not os.listdir(cache)  # nothing cached by process 1
    monkeypatch.undo()

    first = run()
    (folder,) = [os.path.join(cache, d) for d in os.listdir(cache)]
    assert os.path.isfile(os.path.join(folder, "config.json"))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same params on every host

    for f in os.listdir(folder):  # a folder left empty by an older version: computed again, not read
        os.remove(os.path.join(folder, f))
    again = run()
    assert os.path.isfile(os.path.join(folder, "config.json"))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(first)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
