"""Greedy continuous batching (engine and CLI) is token-identical to transformers generate(do_sample=False)."""

import json

import numpy as np
import pytest
import torch

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.engine import Request
from asyncrl.inference.replicas import ReplicaSet
from asyncrl.models import from_pretrained
from asyncrl.rollout import Prompt
from tests.helpers import save_hf_model

PROMPT_LENS = [5, 9, 3, 17, 12, 7, 20, 4, 11, 6, 14, 8, 2, 25]
NEW = 24
EOS = 1


@pytest.fixture(scope="module", params=["qwen3_tied", "llama31"])
def setup(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = save_hf_model(request.param, folder)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, hf.config.vocab_size, size=n).tolist() for n in PROMPT_LENS]
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=EOS, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return folder, prompts, refs


def _generated(c):
    return c.tokens[~(c.forced & (c.tokens == EOS))].tolist()


def test_engine_greedy_matches_transformers(setup):
    folder, prompts, refs = setup
    model, params = from_pretrained(folder)
    cfg = InferenceConfig(group_size=1, max_decode_batch_size=4, max_prefill_prompts=4, max_seq_len=64,
                          max_new_tokens=NEW, temperature=0.0, params_dtype="float32", kv_cache_dtype="float32")
    rs = ReplicaSet(model, params, cfg, None, devices=__import__("jax").devices()[:1], eos_id=EOS)
    out = rs.generate([Request(Prompt(i, p), p) for i, p in enumerate(prompts)])
    assert [r.prompt.position for r in out] == list(range(len(prompts)))
    # max_decode_batch_size (4) < sequences (14): rows were substituted many times.
    assert rs.engines[0].stats.calls >= len(prompts)
    for r, ref in zip(out, refs):
        assert _generated(r.completions[0]) == ref
    assert any(ref[-1] == EOS for ref in refs) or all(len(ref) == NEW for ref in refs)


def test_cli_greedy_matches_transformers(setup, tmp_path, capsys):
    from asyncrl.cli.generate import main

    folder, prompts, refs = setup
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"tokens": p, "id": i}) for i, p in enumerate(prompts)]
    lines.insert(3, "{not json")  # line 4 is bad; every other row must survive
    inp.write_text("\n".join(lines) + "\n")
    rc = main(["--model", folder, "--prompts", str(inp), "--out", str(out), "--max-new-tokens", str(NEW),
               "--max-decode-batch-size", "4"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "in.jsonl:4" in err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == len(prompts) + 1
    assert rows[3] == {"line": 4, "error": rows[3]["error"]} and "in.jsonl:4" in rows[3]["error"]
    good = [r for r in rows if "error" not in r]
    assert [r["id"] for r in good] == list(range(len(prompts)))  # input order
    for r, ref in zip(good, refs):
        assert r["tokens"] == ref
        assert len(r["logprobs"]) == len(ref) and all(lp <= 0 for lp in r["logprobs"])
