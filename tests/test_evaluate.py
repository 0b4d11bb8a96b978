"""`python -m asyncrl.evaluate`: a tiny saved model through the real engine and verifier on the digits task."""

import json
import os
import shutil

import jax
import pytest

from asyncrl.cli.evaluate import encode_prompts, main
from asyncrl.envs.digits import DigitsTask
from asyncrl.models import Model, preset, save_pretrained
from asyncrl.models.tokenizer import Tokenizer, build_char_tokenizer
from asyncrl.tasks import REASONS, Sample, Score, pass_at_k
from asyncrl.tasks.base import stable_hash


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("evalmodel") / "tiny")
    model = Model(preset("tiny"))
    save_pretrained(model, model.init_params(jax.random.PRNGKey(0)), folder)
    tok = build_char_tokenizer(str(tmp_path_factory.mktemp("tok") / "char"))
    for f in os.listdir(tok):
        shutil.copy(os.path.join(tok, f), folder)
    return folder


def test_evaluate_digits_rows_and_pass_at_k(model_dir, tmp_path, monkeypatch, capsys):
    # A random tiny model essentially never answers digits right, so every reward would be 0 and pass@k checks
    # would pass vacuously. Mark a fixed third of the completions correct (keyed on their text) so groups have
    # 0..4 passes; all others keep the real grade. The verifier runs inline (workers: 0), so the patch applies.
    real_score = DigitsTask.score

    def score(self, completion, sample):
        s = real_score(self, completion, sample)
        return Score(1.0, "correct", s.extracted) if stable_hash(completion, sample.id) % 3 == 0 else s

    monkeypatch.setattr(DigitsTask, "score", score)
    out = str(tmp_path / "eval.jsonl")
    rc = main(["--model", model_dir, "--task", "digits", "--n", "4", "--limit", "8", "task.eval_size=8",
               "--max-new-tokens", "6", "--devices", "1", "--out", out])
    assert rc == 0
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == 8 * 4
    assert {r["reason"] for r in rows} <= set(REASONS)
    assert {r["finish_reason"] for r in rows} <= {"eos", "length"}
    for r in rows:
        assert set(r) >= {"id", "prompt", "answer", "completion", "reward", "reason", "extracted", "tokens",
                          "finish_reason", "sample"}
        # at most 6 generated, plus the EOS when sampled; the EOS forced at the limit is left out
        assert len(r["tokens"]) == 6 if r["finish_reason"] == "length" else len(r["tokens"]) <= 7

    ids = list(dict.fromkeys(r["id"] for r in rows))
    assert len(ids) == 8
    groups = [[r for r in rows if r["id"] == i] for i in ids]
    assert all(sorted(r["sample"] for r in g) == [0, 1, 2, 3] for g in groups)

    summary = json.load(open(out + ".summary.json"))
    assert summary["prompts"] == 8 and summary["samples"] == 32 and summary["skipped"] == []
    assert summary["mean_reward"] == pytest.approx(sum(r["reward"] for r in rows) / len(rows))
    assert sum(summary["reasons"].values()) == 32
    passes = [summary[f"pass@{k}"] for k in range(1, 5)]
    for k, got in enumerate(passes, start=1):
        want = sum(pass_at_k(4, sum(r["reward"] >= 1.0 for r in g), k) for g in groups) / len(groups)
        assert got == pytest.approx(want)
    assert all(a <= b + 1e-12 for a, b in zip(passes, passes[1:]))
    assert 0 < passes[0] < passes[-1] < 1  # the patch gives mixed groups, so the checks above are not vacuous
    printed = capsys.readouterr().out
    assert "mean reward" in printed and "pass@4" in printed


def test_too_long_prompts_are_skipped_and_counted(model_dir):
    tok = Tokenizer.from_folder(model_dir)
    samples = [Sample("a", "1 2 3>", "3"), Sample("b", "1 2 3 4 5 6>", "6"),
               Sample("c", [{"role": "user", "content": "9>"}], "9")]
    kept, skipped = encode_prompts(samples, tok, chat=False, context=10)
    assert [p.sample.id for p in kept] == ["a"]  # 6 tokens; "b" has 12, and "c" goes through the chat template
    assert [s["id"] for s in skipped] == ["b", "c"] and skipped[0]["prompt_tokens"] == 12
    assert "context of 10" in skipped[0]["why"]


def test_bad_task_and_flags_are_named(model_dir, tmp_path, capsys):
    assert main(["--model", model_dir, "--task", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--task 'nope'" in err and "digits" in err
    assert main(["--model", model_dir, "--task", "digits", "task.eval_size=-1"]) == 2
    assert "task.eval_size" in capsys.readouterr().err
    assert main(["--model", model_dir, "--task", "digits", "inference.temperature=0.5"]) == 2
    assert "only task.*" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "missing"), "--task", "digits"]) == 2
    assert "--model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--model", model_dir, "--task", "digits", "--n", "0"])
    assert e.value.code == 2 and "--n=0" in capsys.readouterr().err
