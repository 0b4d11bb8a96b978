"""Token exactness of multi-turn trajectories with a real chat template: a Qwen3-style model (Qwen3's vocabulary,
q/k norms) behind Qwen3's own tokenizer and template (`apply_chat_template`), a tool environment whose observations
are rendered by `envs/chat.py`, and the real engine. The trainer's teacher-forced logprobs equal the sampler's at
every model token, observations are masked, and turns whose decode-and-re-encode would change their ids keep the
sampled ids."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.envs.chat import ObservationRenderer
from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.engine import Engine, Request
from asyncrl.models import Model, preset
from asyncrl.models.tokenizer import Tokenizer
from asyncrl.rollout import Prompt, StepResult
from asyncrl.train.batch import build_batch
from asyncrl.train.loss_config import LossConfig
from tests.helpers import build_qwen3_tokenizer

CFG = InferenceConfig(group_size=2, max_decode_batch_size=4, max_prefill_prompts=2, max_seq_len=192, temperature=1.0,
                      params_dtype="float32", kv_cache_dtype="float32", min_prefill_bucket=16, max_turns=3,
                      max_new_tokens=12)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    tok = Tokenizer.from_folder(build_qwen3_tokenizer(str(tmp_path_factory.mktemp("qwen3"))))
    model = Model(dataclasses.replace(preset("tiny"), vocab_size=tok.vocab_size))
    return tok, model, model.init_params(jax.random.PRNGKey(3))


class ToolEnv:
    """Answers each model turn with a tool result, through the chat template, then ends after the third turn."""

    stop = ()

    def __init__(self, prompt, renderer):
        self.prompt, self.renderer, self.turns = list(prompt), renderer, []

    def reset(self):
        return list(self.prompt)

    def step(self, turn):
        self.turns.append(turn)
        if turn.last:
            return StepResult(None, 1.0, True, "correct")
        result = {"role": "tool", "content": f"result {turn.index}: 42"}
        return StepResult(self.renderer.after(turn.tokens, [result]), 0.0, False)


def test_qwen3_chat_trajectories_are_token_exact(qwen3):
    tok, model, params = qwen3
    renderer = ObservationRenderer(tok)
    # The observation is what the template puts after the model's `<|im_end|>`: the tool turn and the next header.
    text = renderer.text([{"role": "tool", "content": "r"}])
    assert text == "\n<|im_start|>user\n<tool_response>\nr\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    prompts = ["What is 6 times 7? Use the tool.", "Add 40 and 2, with the tool."]
    reqs, envs = [], []
    for i, p in enumerate(prompts):
        ids = tok.encode_prompt(p, chat=True)
        assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
        group = [ToolEnv(ids, renderer) for _ in range(2)]
        envs.append(group)
        reqs.append(Request(Prompt(i, p, 2), ids, group))
    out = sorted(Engine(model, params, CFG, tok, seed=2).generate(reqs), key=lambda r: r.prompt.position)

    im_end = tok.encode("<|im_end|>")
    checked = drifted = 0
    for r, group in zip(out, envs):
        for c, env in zip(r.completions, group):
            assert c.n_turns == 3 and c.end_reason == "done"
            full = np.concatenate([r.prompt_tokens, c.tokens])
            lp = np.asarray(model.get_logprobs(params, jnp.asarray(full[None]), jnp.asarray([len(full)]),
                                               temperature=CFG.temperature))[0, len(r.prompt_tokens) - 1:]
            sampled = ~c.forced
            np.testing.assert_allclose(c.logprobs[sampled], lp[sampled], atol=1e-4)  # fp32, every model token
            checked += int(sampled.sum())
            # Observations: forced, out of the loss, and exactly the template's ids (closing the turn if it was cut).
            assert c.forced[c.observation].all() and c.observation.sum() > 0
            for turn in env.turns:
                mine = (c.turns == turn.index) & ~c.observation
                np.testing.assert_array_equal(c.tokens[mine], turn.tokens)  # what the sampler produced
                if turn.last:
                    continue
                obs = c.tokens[(c.turns == turn.index) & c.observation]
                expect = ([] if list(turn.tokens[-1:]) == im_end else im_end) + renderer.ids(
                    [{"role": "tool", "content": f"result {turn.index}: 42"}])
                np.testing.assert_array_equal(obs, expect)
                # Token drift: decoding this turn and encoding it again gives other ids; the record kept the sampled.
                if tok.encode(tok.decode(turn.tokens, skip_special_tokens=False)) != list(turn.tokens):
                    drifted += 1
            # The whole history decoded and re-encoded (what a text-based pipeline trains on) is not the trajectory.
            history = tok.decode(full, skip_special_tokens=False)
            assert history.count("<tool_response>") == 2
    assert checked >= 4 * 24 and drifted > 0, (checked, drifted)
    batch = build_batch(out, LossConfig(max_tokens=64))
    for b, (r, c) in enumerate((g, c) for g in out for c in g.completions):
        p = len(r.prompt_tokens)
        np.testing.assert_array_equal(batch.loss_mask[b, p:p + len(c.tokens)], ~c.forced)


def test_a_constructed_drift_case_keeps_the_sampled_ids(qwen3):
    """A model built to say "hel" then "lo" then `<|im_end|>`: the text "hello<|im_end|>" re-encodes to other ids
    ("hello" is one token), so a pipeline that decodes the turn and encodes it again trains on ids the sampler never
    produced. The trajectory keeps the sampled ids, the environment sees them, and the trainer scores them."""
    tok, _, _ = qwen3
    hel, lo, (hello,), (im_end,) = tok.encode("hel"), tok.encode("lo"), tok.encode("hello"), tok.encode("<|im_end|>")
    assert len(hel) == len(lo) == 1
    turn_ids = [hel[0], lo[0], im_end]
    assert tok.encode(tok.decode(turn_ids, skip_special_tokens=False)) == [hello, im_end]  # the drift
    ids = tok.encode_prompt("Say hello.", chat=True)

    # Attention and MLP write nothing (wo = w_down = 0), so the residual at a position is its token's embedding and
    # the next token is read from the lm head: prompt's last token -> "hel" -> "lo" -> <|im_end|>.
    model = Model(dataclasses.replace(preset("tiny"), vocab_size=tok.vocab_size, tie_word_embeddings=False))
    p = model.init_params(jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    embed = rng.normal(size=(tok.vocab_size, p.embed.shape[1])).astype(np.float32)
    embed /= np.linalg.norm(embed, axis=1, keepdims=True)
    head = np.zeros(p.lm_head.shape, np.float32)
    for a, b in [(ids[-1], hel[0]), (hel[0], lo[0]), (lo[0], im_end)]:
        head[:, b] = 6.0 * embed[a]
    layers = dataclasses.replace(p.layers, wo=jnp.zeros_like(p.layers.wo), w_down=jnp.zeros_like(p.layers.w_down))
    p = dataclasses.replace(p, embed=jnp.asarray(embed), lm_head=jnp.asarray(head), layers=layers)
    seen = []

    class Once:
        stop = ()

        def reset(self):
            return list(ids)

        def step(self, turn):
            seen.append(turn)
            return StepResult(None, 1.0, True)

    cfg = dataclasses.replace(CFG, group_size=1, max_turns=1, max_new_tokens=6)
    (r,) = Engine(model, p, cfg, tok, seed=0).generate([Request(Prompt(0, "hello", 1), ids, [Once()])])
    (c,) = r.completions
    assert list(c.tokens) == turn_ids and list(seen[0].tokens) == turn_ids  # kept, not re-encoded
    full = np.concatenate([ids, c.tokens])
    lp = np.asarray(model.get_logprobs(p, jnp.asarray(full[None]), jnp.asarray([len(full)]), temperature=1.0))
    np.testing.assert_allclose(c.logprobs, lp[0, len(ids) - 1:], atol=1e-4)
    batch = build_batch([r], LossConfig(max_tokens=64))
    np.testing.assert_array_equal(batch.tokens[0, len(ids):len(ids) + 3], turn_ids)
