"""Local math files in each published layout, as JSONL and parquet, with malformed rows mixed in."""

import itertools
import json
import logging
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.envs import build_task
from asyncrl.envs.math_file import MathFileTask
from asyncrl.envs.math_loader import DAPO_PREFIX, DAPO_SUFFIX, MathFileLoader, detect_schema
from asyncrl.tasks import TaskConfig, TaskSourceConfig
from asyncrl.tasks.prompts import PromptFormat


def dapo(i):
    return {"data_source": "math_dapo", "ability": "MATH",
            "prompt": [{"content": f"{DAPO_PREFIX}What is {i} + {i}?{DAPO_SUFFIX}", "role": "user"}],
            "reward_model": {"ground_truth": str(2 * i), "style": "rule-lean"}, "extra_info": {"index": f"uuid-{i}"}}


def math500(i):
    return {"problem": f"Compute $\\frac{{{i}}}{{2}}$.", "solution": "Divide.", "answer": f"\\frac{{{i}}}{{2}}",
            "subject": "Algebra", "level": 1 + i % 5, "unique_id": f"test/algebra/{i}.json"}


def aime2024(i):
    return {"ID": f"2024-I-{i}", "Problem": f"Find {i} times 3.", "Solution": "Multiply.", "Answer": 3 * i}


def aime2025(i):
    return {"id": str(i), "problem": f"Find {i} minus 1.", "answer": str(i - 1), "solution": "", "url": None}


def amc(i):
    return {"id": i, "problem": f"What is {i} squared?", "answer": float(i * i), "url": f"https://amc/{i}"}


def gsm8k(i):
    return {"question": f"Tom has {i} apples and buys 1000 more. How many?",
            "answer": f"He has {i} + 1000 = <<{i}+1000={i + 1000}>>{i + 1000}.\n#### {i + 1000:,}"}


GOOD = {"dapo": dapo, "math500": math500, "aime2024": aime2024, "aime2025": aime2025, "amc": amc, "gsm8k": gsm8k}
EXPECTED_ANSWER = {"dapo": lambda i: str(2 * i), "math500": lambda i: f"\\frac{{{i}}}{{2}}",
                   "aime2024": lambda i: str(3 * i), "aime2025": lambda i: str(i - 1), "amc": lambda i: str(i * i),
                   "gsm8k": lambda i: str(i + 1000)}
# One field per layout whose absence, or whose wrong type, makes a row unusable.
KEY_FIELD = {"dapo": "reward_model", "math500": "answer", "aime2024": "Problem", "aime2025": "answer",
             "amc": "problem", "gsm8k": "answer"}


def write_jsonl(path, schema):
    """3 good rows, then malformed rows at known lines; returns the malformed line numbers."""
    make = GOOD[schema]
    missing = make(4)
    del missing[KEY_FIELD[schema]]
    wrong_type = make(5)
    wrong_type[KEY_FIELD[schema]] = [1, 2] if schema != "dapo" else "not a dict"
    lines = [json.dumps(make(1)).encode(), json.dumps(make(2)).encode(), b"", json.dumps(make(3)).encode(),
             b'{"problem": "unterminated', json.dumps(missing).encode(), json.dumps(wrong_type).encode(),
             b"[1, 2, 3]", b'{"problem": "caf\xe9", "answer": "1"}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    return [5, 6, 7, 8, 9]


def write_parquet(path, schema):
    """3 good rows, then rows with a null and an empty key field; returns their 0-based row indices."""
    make = GOOD[schema]
    rows = [make(1), make(2), make(3), make(4), make(5)]
    rows[3][KEY_FIELD[schema]] = None
    if schema == "dapo":
        rows[4]["prompt"] = [{"content": "only a system message", "role": "system"}]
    else:
        rows[4][KEY_FIELD[schema]] = "" if isinstance(rows[4][KEY_FIELD[schema]], str) else None
    pq.write_table(pa.Table.from_pylist(rows), path)
    return [3, 4]


@pytest.mark.parametrize("schema", sorted(GOOD))
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_each_layout_loads_and_reports_malformed_rows(tmp_path, caplog, schema, fmt):
    path = tmp_path / f"{schema}.{fmt}"
    bad = write_jsonl(path, schema) if fmt == "jsonl" else write_parquet(path, schema)
    loader = MathFileLoader(str(path))
    with caplog.at_level(logging.WARNING, logger="asyncrl.envs.math_file"):
        rows = loader.load()
    assert loader.schema_name == schema
    assert [r.answer for r in rows] == [EXPECTED_ANSWER[schema](i) for i in (1, 2, 3)]
    assert all(r.problem.strip() and DAPO_PREFIX not in r.problem for r in rows)
    assert [s.index for s in loader.skipped] == bad
    assert {s.unit for s in loader.skipped} == {"line" if fmt == "jsonl" else "row"}
    assert all(s.path == str(path) for s in loader.skipped)
    assert f"{path} {'line' if fmt == 'jsonl' else 'row'} {bad[0]}" in caplog.text
    assert f"skipped {len(bad)} malformed rows" in caplog.text


def test_skip_reasons_name_the_problem(tmp_path):
    path = tmp_path / "m.jsonl"
    write_jsonl(path, "math500")
    loader = MathFileLoader(str(path))
    loader.load()
    reasons = [s.reason for s in loader.skipped]
    assert "invalid JSON" in reasons[0]
    assert "missing field 'answer'" in reasons[1]
    assert "field 'answer' is list" in reasons[2]
    assert "expected an object" in reasons[3]
    assert "invalid UTF-8" in reasons[4]


def test_ids_and_metadata_follow_the_layout(tmp_path):
    path = tmp_path / "m.jsonl"
    write_jsonl(path, "math500")
    rows = MathFileLoader(str(path)).load()
    assert rows[0].id == "test/algebra/1.json" and rows[0].metadata == {"subject": "Algebra", "level": 2}
    path = tmp_path / "g.jsonl"
    write_jsonl(path, "gsm8k")
    assert MathFileLoader(str(path)).load()[0].id == "g:1"  # GSM8K has no id: file stem and line


def test_detection_from_fields():
    assert detect_schema(aime2025(3)) == "aime2025"
    assert detect_schema({"question": "q", "answer": "7"}) == "aime2025"  # opencompass/AIME2025
    assert detect_schema(gsm8k(1)) == "gsm8k"
    assert detect_schema({"text": "x"}) is None


def test_missing_and_unknown_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        MathFileLoader(str(tmp_path / "nope.jsonl")).load()
    with pytest.raises(FileNotFoundError, match=r"\*\.parquet"):
        MathFileLoader(str(tmp_path / "*.parquet")).load()
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"text": "x", "label": 1}) + "\n")
    with pytest.raises(ValueError, match="odd.jsonl.*'label', 'text'.*field_map"):
        MathFileLoader(str(odd)).load()
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(ValueError, match="x.parquet.*not a readable parquet"):
        MathFileLoader(str(not_parquet), schema="math500").load()


def test_field_map_with_dotted_paths_and_json_arrays(tmp_path):
    path = tmp_path / "custom.json"
    path.write_text(json.dumps([{"q": "1+1?", "sol": {"final": 2}, "key": "a"}, {"q": "2+2?", "sol": {}}]))
    loader = MathFileLoader(str(path), field_map={"problem": "q", "answer": "sol.final", "id": "key"})
    rows = loader.load()
    assert [(r.problem, r.answer, r.id) for r in rows] == [("1+1?", "2", "a")]
    assert [(s.unit, s.index) for s in loader.skipped] == [("row", 1)]
    assert "sol.final" in loader.skipped[0].reason


def test_glob_reads_every_shard(tmp_path):
    for shard in range(2):
        rows = [math500(10 * shard + i) for i in range(3)]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"s{shard}.parquet")
    assert len(MathFileLoader(str(tmp_path / "s*.parquet")).load()) == 6


# ---- the task -----------------------------------------------------------------------------------------------


def _many(tmp_path, n=40, extra=()):
    path = tmp_path / "many.jsonl"
    rows = [math500(i) for i in range(n)] + list(extra)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_eval_is_held_out_and_deterministic(tmp_path):
    # Five exact copies of problem 0 (dropped at load) and two restatements with other answers (kept, and always
    # on the same side of the split as problem 0: the split is by problem text).
    variants = [{**math500(0), "answer": a, "unique_id": f"v{a}"} for a in ("7", "8")]
    task = MathFileTask(_many(tmp_path, extra=[math500(0)] * 5 + variants), eval_size=10)
    ev = list(task.samples("eval", seed=1))
    assert task.loader.duplicates == 5 and len(task.rows()) == 42
    assert len(ev) == 10 and len({s.prompt for s in ev}) == 10
    assert [s.id for s in ev] == [s.id for s in task.samples("eval", seed=1)]
    assert [s.id for s in ev] != [s.id for s in task.samples("eval", seed=2)]
    train = list(itertools.islice(task.samples("train", seed=1), 200))
    held = {s.prompt for s in ev}
    assert not held & {s.prompt for s in train}
    # Each epoch covers every row not held out (restatements included) once, in a fresh order.
    expected = sorted(PromptFormat().render(r.problem) for r in task.rows()
                      if PromptFormat().render(r.problem) not in held)
    n_train = len(expected)
    assert n_train in (30, 32)  # 32 when problem 0 and its restatements are in train
    assert sorted(s.prompt for s in train[:n_train]) == expected
    assert [s.id for s in train[:n_train]] != [s.id for s in train[n_train:2 * n_train]]


def test_source_split_train_or_eval_only(tmp_path):
    path = _many(tmp_path, n=12)
    with pytest.raises(ValueError, match="would hold out all 12"):
        next(MathFileTask(path, use="both", eval_size=12).samples("train", 0))
    assert list(MathFileTask(path, use="train").samples("eval", 0)) == []
    only_eval = MathFileTask(path, use="eval", eval_size=3)
    assert len(list(only_eval.samples("eval", 0))) == 12  # an eval-only file is used whole
    assert list(only_eval.samples("train", 0)) == []


def test_prompt_templates(tmp_path):
    path = _many(tmp_path, n=3)
    plain = next(MathFileTask(path, use="train").samples("train", 0))
    assert isinstance(plain.prompt, str) and plain.prompt.endswith("\\boxed{}.") and "Compute" in plain.prompt
    chat_task = MathFileTask(path, use="train", prompt=PromptFormat("chat", "You are a careful mathematician."))
    chat = next(chat_task.samples("train", 0))
    assert [m["role"] for m in chat.prompt] == ["system", "user"]
    assert chat.prompt[0]["content"] == "You are a careful mathematician." and "\\boxed{}" in chat.prompt[1]["content"]


def test_scoring_accepts_each_datasets_own_answer_format(tmp_path):
    for schema, right, wrong in [("dapo", "so\nAnswer: 4", "Answer: 5"), ("gsm8k", "#### 1002", "#### 1003"),
                                 ("math500", r"\boxed{1}", r"\boxed{2}")]:
        path = tmp_path / f"{schema}.jsonl"
        path.write_text(json.dumps(GOOD[schema](2)) + "\n")
        task = MathFileTask(str(path), use="train")
        sample = next(task.samples("train", 0))
        assert task.score(f"<think>Answer: 0</think>{right}", sample).reason == "correct", schema
        assert task.score(wrong, sample).reason == "wrong", schema
        # What a verifier worker receives: no rows, same grading; rows are re-read only if asked for.
        clone = pickle.loads(pickle.dumps(task))
        assert clone._rows is None and clone.score(right, sample).reason == "correct"
        assert next(clone.samples("train", 0)) == sample


def test_build_from_config(tmp_path):
    path = _many(tmp_path, n=20)
    cfg = TaskConfig(sources=[TaskSourceConfig(environment="math_file", path=path, options={"label": "m5"})],
                     prompt_template="chat", eval_size=4)
    task = build_task(cfg)
    assert isinstance(task, MathFileTask) and task.label == "m5"
    ev = list(task.samples("eval", cfg.seed))
    assert len(ev) == 4 and all(s.id.startswith("m5/") and s.metadata["task"] == "m5" for s in ev)
    bad = TaskConfig(sources=[TaskSourceConfig(environment="math_file", path=str(tmp_path / "missing.jsonl"))])
    with pytest.raises(ValueError, match=r"task.sources\[0\].path=.*missing.jsonl"):
        build_task(bad)
    with pytest.raises(ValueError, match=r"task.sources\[0\].options.*nope"):
        build_task(TaskConfig(sources=[TaskSourceConfig(environment="math_file", path=path, options={"nope": 1})]))
