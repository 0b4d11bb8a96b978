"""Engine behaviour: logprob semantics, forcing, compile stability, reproducibility, SPMD, carry-over, versions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.engine import Engine, Request
from asyncrl.inference.forcing import force_end_of_think, force_eos
from asyncrl.inference.replicas import ReplicaSet
from asyncrl.inference.state import FinishedRow, pack_row, unpack_row
from asyncrl.rollout import Prompt

BASE = InferenceConfig(group_size=2, max_decode_batch_size=4, max_prefill_prompts=4, max_seq_len=48,
                       temperature=1.0, params_dtype="float32", kv_cache_dtype="float32", min_prefill_bucket=8)


def _requests(tok, n=6, k=2):
    texts = ["3 1 4 1 5>", "9 2 6>", "5 3 5 8 9 7 9>", "3 2>", "8 4 6 2 6 4 3 3>", "8 3 2 7 9>", "5 0>",
             "2 8 8 4 1 9 7 1>"]
    return [Request(Prompt(i, t, k), tok.encode(t)) for i, t in enumerate(texts[:n])]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_match_teacher_forced(model_params, tok, temperature):
    model, params = model_params
    cfg = dataclasses.replace(BASE, temperature=temperature)
    out = ReplicaSet(model, params, cfg, tok, devices=jax.devices()[:1], seed=3).generate(_requests(tok))
    checked = 0
    for r in out:
        for c in r.completions:
            full = np.concatenate([r.prompt_tokens, c.tokens])
            lp = model.get_logprobs(params, jnp.asarray(full[None]), jnp.asarray([len(full)]), temperature=temperature)
            lp = np.asarray(lp)[0, len(r.prompt_tokens) - 1 :]  # logprob of token t+1 sits at index t
            sampled = ~c.forced
            np.testing.assert_allclose(c.logprobs[sampled], lp[sampled], atol=1e-4)
            checked += int(sampled.sum())
    assert checked > 50


def test_length_forced_eos_has_logprob_zero_and_is_marked(model_params, tok):
    model, params = model_params
    cfg = dataclasses.replace(BASE, max_seq_len=20)
    out = ReplicaSet(model, params, cfg, tok, devices=jax.devices()[:1]).generate(_requests(tok))
    lengths = [c for r in out for c in r.completions if c.finish_reason == "length"]
    assert lengths, "a random tiny model should hit the length limit"
    for r in out:
        for c in r.completions:
            assert len(r.prompt_tokens) + len(c.tokens) <= 20
            assert c.tokens[-1] == tok.eos_id
            if c.finish_reason == "length":
                assert c.forced[-1] and c.logprobs[-1] == 0.0
                assert not c.forced[:-1].any()
            else:
                assert not c.forced.any()


def test_reasoning_budget_phrase_ends_exactly_at_budget(model_params, tok):
    model, params = model_params
    phrase = "Stop.</think>"
    ids = tok.encode(phrase)
    assert ids[-1] == tok.end_of_think_id
    cfg = dataclasses.replace(BASE, reasoning_budget=16, think_phrase=phrase, max_seq_len=40)
    out = ReplicaSet(model, params, cfg, tok, devices=jax.devices()[:1]).generate(_requests(tok))
    n_forced = 0
    for r in out:
        for c in r.completions:
            if len(c.tokens) < 16 or (c.tokens[: 16 - len(ids)] == tok.end_of_think_id).any():
                continue  # finished early or closed thinking on its own
            n_forced += 1
            assert c.tokens[16 - len(ids) : 16].tolist() == ids  # ends exactly at the budget
            assert c.forced[16 - len(ids) : 16].all() and (c.logprobs[16 - len(ids) : 16] == 0).all()
            assert c.ended_thinking
    assert n_forced > 0


def test_force_end_of_think_leaves_rows_that_ended_thinking_alone():
    phrase = [7, 8, 9]
    tok = jnp.array([1, 1, 1, 1])
    lp = jnp.array([-1.0, -1.0, -1.0, -1.0])
    eot = jnp.array([False, True, False, False])
    prompt = jnp.array([5, 5, 5, 5])
    index = prompt + jnp.array([7, 7, 9, 3])  # completion positions 7, 7, 9 (last phrase slot), 3 (too early)
    new, newlp, forced, eot2 = force_end_of_think(tok, lp, eot, index, prompt, budget=10, phrase=phrase)
    assert new.tolist() == [7, 1, 9, 1]
    assert forced.tolist() == [True, False, True, False]
    assert newlp.tolist() == [0.0, -1.0, 0.0, -1.0]
    assert eot2.tolist() == [False, True, True, False]
    t, l, f, stop, hit = force_eos(jnp.array([3, 2]), jnp.array([-0.5, -0.2]), jnp.array([False, False]),
                                   jnp.array([9, 4]), limit=10, eos_id=2)
    assert t.tolist() == [2, 2] and np.allclose(l, [0.0, -0.2]) and f.tolist() == [True, False]
    assert stop.tolist() == [True, True] and hit.tolist() == [True, False]


def test_compile_stability_after_warmup(model_params, tok):
    model, params = model_params
    compiles = []
    # A program compiled, or loaded from the persistent compilation cache (tests/conftest.py: a program another
    # test compiled first is a hit, which a jit cache miss after warm-up would be too).
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *a, **k: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
    jax.monitoring.register_event_listener(
        lambda name, **k: compiles.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
    cfg = dataclasses.replace(BASE, max_seq_len=64, min_prefill_bucket=8)
    eng = Engine(model, params, cfg, tok, seed=1)
    # On the CPU the engine decodes with per-layer weights, split once here (and once per weight sync).
    assert isinstance(eng.params.layers, tuple) and len(eng.params.layers) == model.cfg.num_layers
    eng.set_params(params, 1)  # a second sync with the same shapes compiles nothing new either
    rng = np.random.default_rng(0)

    def batch(lengths):
        return [Request(Prompt(i, None, 2), rng.integers(10, 90, size=n).tolist()) for i, n in enumerate(lengths)]

    eng.generate(batch([3, 8]) + batch([9, 16]) + batch([17, 32]) + batch([33, 60]))  # every bucket: 8,16,32,64
    warm = len(compiles)
    for v in range(3):
        eng.set_params(params, 2 + v)  # every weight sync reuses the compiled layout conversion
        eng.generate(batch(rng.integers(1, 62, size=8).tolist()))
    assert len(compiles) == warm, f"{len(compiles) - warm} new compilations after warm-up"
    assert warm > 0


def test_same_seed_same_samples(model_params, tok):
    model, params = model_params
    a = ReplicaSet(model, params, BASE, tok, devices=jax.devices()[:1], seed=7).generate(_requests(tok))
    b = ReplicaSet(model, params, BASE, tok, devices=jax.devices()[:1], seed=7).generate(_requests(tok))
    c = ReplicaSet(model, params, BASE, tok, devices=jax.devices()[:1], seed=8).generate(_requests(tok))
    toks = lambda out: [x.tokens.tolist() for r in out for x in r.completions]  # noqa: E731
    assert toks(a) == toks(b)
    assert toks(a) != toks(c)


def test_one_vs_two_replicas_greedy_same_outputs(model_params, tok):
    model, params = model_params
    cfg = dataclasses.replace(BASE, temperature=0.0, group_size=1)
    one = ReplicaSet(model, params, cfg, tok, devices=jax.devices()[:1]).generate(_requests(tok, 8, 1))
    two_rs = ReplicaSet(model, params, cfg, tok, devices=jax.devices()[:2])
    assert len(two_rs) == 2
    two = two_rs.generate(_requests(tok, 8, 1))
    assert sorted(tuple(r.completions[0].tokens) for r in one) == sorted(tuple(r.completions[0].tokens) for r in two)
    assert all(e.stats.finished > 0 for e in two_rs.engines)  # both replicas did work


def test_spmd_matches_single_replica_on_4_devices(model_params, tok):
    model, params = model_params
    cfg = dataclasses.replace(BASE, temperature=0.0, group_size=1)
    ref = ReplicaSet(model, params, cfg, tok, devices=jax.devices()[:1]).generate(_requests(tok, 8, 1))
    for substitute in ("auto", "naive"):
        spmd_cfg = dataclasses.replace(cfg, replica_mode="spmd")
        rs = ReplicaSet(model, params, spmd_cfg, tok, devices=jax.devices()[:4], substitute=substitute)
        state = rs.engines[0].programs.new_state()
        # The decode batch is really split over dp (the CPU keeps one cache leaf per layer).
        assert all(leaf.sharding.spec[1] == "dp" for leaf in jax.tree.leaves(state.kv.k))
        out = rs.generate(_requests(tok, 8, 1))
        assert [r.completions[0].tokens.tolist() for r in out] == [r.completions[0].tokens.tolist() for r in ref]


def test_in_flight_rows_carry_over_and_record_versions(model_params, tok):
    model, params = model_params
    cfg = dataclasses.replace(BASE, group_size=4, max_decode_batch_size=4)
    eng = Engine(model, params, cfg, tok, seed=2)
    calls = {"n": 0}

    def hook():  # an in-flight weight update after a few decode loops
        calls["n"] += 1
        if calls["n"] == 6:
            eng.set_params(params, 5)

    eng.between_loops = hook
    first = eng.generate(_requests(tok, 2, 4), drain=False)
    assert eng.in_flight > 0  # rows carried, not drained
    rest = eng.generate(_requests(tok, 2, 4)[::-1], drain=True)
    groups = first + rest
    assert sum(len(g.completions) for g in groups) == 16 and all(g.done for g in groups)
    spans = [c for g in groups for c in g.completions if c.version_boundaries]
    assert spans, "some sample must straddle the update"
    c = spans[0]
    assert c.start_version == 0 and c.end_version == 5 and c.version_boundaries[0][1] == 5


def test_decode_chunks_return_to_the_host_without_changing_samples(model_params, tok):
    """decode_chunk_steps bounds how long the device runs before `between_loops` (where a weight sync parks the
    replica); samples are seeded per (prompt, sample, position), so chunking changes nothing in the output."""
    model, params = model_params
    outs, engines = {}, {}
    for chunk in (1, 3, 10_000):
        cfg = dataclasses.replace(BASE, max_seq_len=40, decode_chunk_steps=chunk)
        eng = Engine(model, params, cfg, tok, seed=5)
        gaps, last = [], {"steps": 0}

        def hook(eng=eng, gaps=gaps, last=last):  # decode steps executed since the previous hook call
            gaps.append(eng.stats.decode_steps - last["steps"])
            last["steps"] = eng.stats.decode_steps

        eng.between_loops = hook
        outs[chunk] = eng.generate(_requests(tok, 6, 2))
        engines[chunk] = (eng, gaps)
    toks = lambda out: [(r.prompt.position, [c.tokens.tolist() for c in r.completions]) for r in out]  # noqa: E731
    assert toks(outs[1]) == toks(outs[3]) == toks(outs[10_000])
    for chunk in (1, 3):
        eng, gaps = engines[chunk]
        assert max(gaps) <= chunk  # the host regains control at least every `chunk` executed steps
    assert max(engines[10_000][1]) > 3  # unchunked: loops run until a row finishes
    assert engines[1][0].stats.calls > engines[3][0].stats.calls > engines[10_000][0].stats.calls


def test_a_group_prefilled_before_a_swap_counts_its_prompt_cache_version(model_params, tok):
    """A replica prefills under version 0, then parks and takes version 1 before its first decode step: every
    sampled token is tagged 1, but the prompt's cached keys and values were computed by version 0. The group's lag
    counts the prefill's version (`Completion.prompt_version`), not only the tokens'."""
    model, params = model_params
    cfg = dataclasses.replace(BASE, group_size=2, max_decode_batch_size=4)
    eng = Engine(model, params, cfg, tok, seed=2)
    swapped = []

    def hook():  # the first decode loop after the prefill: a weight sync lands here
        if not swapped:
            swapped.append(True)
            eng.set_params(params, 1)

    eng.between_loops = hook
    out = eng.generate(_requests(tok, 1, 2), drain=True)
    (g,) = out
    assert all((c.versions == 1).all() for c in g.completions)  # every token sampled under version 1 ...
    assert g.oldest_version == 0  # ... from a prompt cache of version 0, which the lag counts
    assert all(c.prompt_version == 0 for c in g.completions)


def test_a_finished_row_packs_into_one_vector_and_back_unchanged():
    """The decode program hands its row to the host as one int32 vector; every field comes back bit for bit (the
    logprobs through a bit-cast, so -0.0, tiny and NaN values too), with its flags as booleans."""
    S = 7
    rng = np.random.default_rng(0)
    lp = rng.normal(size=S).astype(np.float32)
    lp[:3] = [-0.0, np.float32(1e-42), np.nan]
    row = FinishedRow(tokens=rng.integers(0, 1 << 20, S).astype(np.int32), logprobs=lp,
                      forced=rng.random(S) < 0.5, versions=rng.integers(0, 9, S).astype(np.int32),
                      prompt_len=np.int32(3), length=np.int32(6), slot=np.int32(-1), hit_length=np.bool_(True),
                      end_of_think=np.bool_(False), steps=np.int32(11), inserted=np.bool_(True), row=np.int32(5))
    packed = jax.jit(pack_row)(jax.tree.map(jnp.asarray, row))
    assert packed.shape == (4 * S + 8,) and packed.dtype == jnp.int32
    back = unpack_row(np.asarray(packed), S)
    for name in ("tokens", "forced", "versions"):
        np.testing.assert_array_equal(getattr(back, name), getattr(row, name))
    assert back.forced.dtype == bool
    np.testing.assert_array_equal(back.logprobs.view(np.int32), lp.view(np.int32))
    for name in ("prompt_len", "length", "slot", "steps", "row", "hit_length", "end_of_think", "inserted"):
        assert getattr(back, name) == getattr(row, name) and type(getattr(back, name)) is type(getattr(row, name))
