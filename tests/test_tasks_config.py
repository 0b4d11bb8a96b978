"""Task config: validation messages name the dotted key, YAML presets fill the dataclasses, fields are documented."""

import ast
import inspect
import itertools
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from asyncrl.envs import build_task
from asyncrl.envs.math_loader import DAPO_PREFIX, DAPO_SUFFIX
from asyncrl.tasks import MixtureTask, TaskConfig, TaskSourceConfig, VerifierConfig, config as config_module

PRESETS = os.path.join(os.path.dirname(__file__), "..", "configs", "task")


def load_preset(name: str, **overrides) -> TaskConfig:
    merged = OmegaConf.merge(OmegaConf.structured(TaskConfig), OmegaConf.load(os.path.join(PRESETS, f"{name}.yaml")),
                             OmegaConf.create(overrides))
    return OmegaConf.to_object(merged)


@pytest.mark.parametrize("make,message", [
    (lambda: TaskConfig(sources=[TaskSourceConfig(), TaskSourceConfig(weight=-1)]),
     "task.sources[1].weight=-1 is invalid: must be > 0"),
    (lambda: TaskConfig(sources=[]), "task.sources=[] is invalid"),
    (lambda: TaskConfig(sources=[TaskSourceConfig(split="test")]), "task.sources[0].split='test' is invalid"),
    (lambda: TaskConfig(sources=[TaskSourceConfig(schema="math")]), "task.sources[0].schema='math' is invalid"),
    (lambda: TaskConfig(sources=[TaskSourceConfig(field_map={"question": "q"})]),
     "task.sources[0].field_map='question'"),
    (lambda: TaskConfig(sources=[TaskSourceConfig(field_map={"problem": "q"})]),
     "task.sources[0].field_map={'problem': 'q'} is invalid: must be a mapping that names 'answer'"),
    (lambda: TaskConfig(prompt_template="jinja"), "task.prompt_template='jinja' is invalid"),
    (lambda: TaskConfig(eval_size=-1), "task.eval_size=-1 is invalid"),
    (lambda: VerifierConfig(mode="fuzzy"), "task.verifier.mode='fuzzy' is invalid"),
    (lambda: VerifierConfig(timeout_s=0), "task.verifier.timeout_s=0 is invalid: must be > 0"),
    (lambda: VerifierConfig(workers=-1), "task.verifier.workers=-1 is invalid"),
    (lambda: VerifierConfig(memory_limit_mb=10), "task.verifier.memory_limit_mb=10 is invalid"),
])
def test_validation_errors_name_the_dotted_key(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert message in str(e.value)


def test_yaml_override_errors_name_the_indexed_key():
    with pytest.raises(ValueError, match=r"task.sources\[0\].weight=-1.0 is invalid: must be > 0"):
        load_preset("digits", sources=[{"environment": "digits", "weight": -1}])


def test_unknown_environment_fails_at_build():
    with pytest.raises(ValueError, match=r"task.sources\[0\].environment='chess' is invalid: must be a built-in "
                                         r"environment \(agent, digits, .*\) or an import path"):
        build_task(TaskConfig(sources=[TaskSourceConfig(environment="chess")]))


def test_duplicate_labels_fail_at_build():
    with pytest.raises(ValueError, match=r"task.sources\[1\].options.label='digits'"):
        build_task(TaskConfig(sources=[TaskSourceConfig(), TaskSourceConfig(options={"op": "min"})]))


def test_every_config_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(config_module))
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and \
                    isinstance(nxt.value.value, str) and len(nxt.value.value) > 10
                assert documented, f"{cls.name}.{node.target.id} has no docstring"


@pytest.mark.parametrize("name", ["digits", "arithmetic", "gsm_symbolic"])
def test_generated_presets_build_and_yield(name):
    cfg = load_preset(name, eval_size=4)
    task = build_task(cfg)
    train = list(itertools.islice(task.samples("train", cfg.seed), 5))
    ev = list(task.samples("eval", cfg.seed))
    assert len(train) == 5 and len(ev) == 4
    if name == "digits":
        assert isinstance(train[0].prompt, str) and cfg.verifier.workers == 0
    else:
        assert [m["role"] for m in train[0].prompt] == ["system", "user"]
        assert task.score(f"\\boxed{{{train[0].answer}}}", train[0]).reason == "correct"


def test_math_files_preset_builds_a_weighted_mixture(tmp_path):
    cfg = load_preset("math_files")
    assert [s.split for s in cfg.sources] == ["train", "train", "eval", "eval"]
    # Point the preset's sources at fixture files in each layout.
    dapo = [{"prompt": [{"role": "user", "content": f"{DAPO_PREFIX}What is {i}+{i}?{DAPO_SUFFIX}"}],
             "reward_model": {"ground_truth": str(2 * i)}, "data_source": "math_dapo", "extra_info": {"index": str(i)}}
            for i in range(30)]
    pq.write_table(pa.Table.from_pylist(dapo), tmp_path / "dapo.parquet")
    os.makedirs(tmp_path / "gsm8k")
    gsm = [{"question": f"Sam has {i} pens. How many?", "answer": f"He has {i}.\n#### {i}"} for i in range(10)]
    pq.write_table(pa.Table.from_pylist(gsm), tmp_path / "gsm8k" / "train-00000-of-00001.parquet")
    with open(tmp_path / "math500.jsonl", "w") as f:
        for i in range(5):
            f.write(json.dumps({"problem": f"p{i}", "solution": "", "answer": f"{i}", "subject": "Algebra",
                                "level": 1, "unique_id": f"test/{i}.json"}) + "\n")
    pq.write_table(pa.Table.from_pylist([{"ID": f"2024-I-{i}", "Problem": f"q{i}", "Solution": "", "Answer": i}
                                         for i in range(3)]), tmp_path / "aime.parquet")
    paths = [tmp_path / "dapo.parquet", tmp_path / "gsm8k" / "train-*.parquet", tmp_path / "math500.jsonl",
             tmp_path / "aime.parquet"]
    sources = [{**OmegaConf.to_container(OmegaConf.structured(s)), "path": str(p)} for s, p in zip(cfg.sources, paths)]
    cfg = load_preset("math_files", sources=sources)
    task = build_task(cfg)
    assert isinstance(task, MixtureTask)
    train = list(itertools.islice(task.samples("train", cfg.seed), 400))
    labels = [s.metadata["task"] for s in train]
    assert labels.count("dapo") == 300 and labels.count("gsm8k") == 100  # weights 3:1, eval-only sources skipped
    assert max(len(list(g)) for _, g in itertools.groupby(labels)) <= 3  # interleaved, not in blocks
    ev = list(task.samples("eval", cfg.seed))
    assert [s.metadata["task"] for s in ev] == ["math500"] * 5 + ["aime2024"] * 3
    # The mixture grades each sample with its own source's rules (DAPO accepts its `Answer:` line).
    dapo_sample = next(s for s in train if s.metadata["task"] == "dapo")
    assert task.score(f"Answer: {dapo_sample.answer}", dapo_sample).reason == "correct"
    gsm_sample = next(s for s in train if s.metadata["task"] == "gsm8k")
    assert task.score(f"#### {gsm_sample.answer}", gsm_sample).reason == "correct"
    assert task.score(r"\boxed{2}", ev[-1]).reason == "correct"  # aime2024 row 2, answer 2
