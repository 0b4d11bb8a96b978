"""Multi-turn rollouts through the real engine (`inference/engine.py`, `episodes.py`, the park and extend programs):
token-exact trajectories, observations masked, KV continued across turns, limits, failures and stop sequences."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncrl.inference.config import InferenceConfig
from asyncrl.inference.engine import Engine, Request
from asyncrl.inference.replicas import ReplicaSet
from asyncrl.models import Model
from asyncrl.models.kvcache import KVCache
from asyncrl.rollout import Prompt, StepResult
from asyncrl.train.batch import build_batch
from asyncrl.train.loss_config import LossConfig

BASE = InferenceConfig(group_size=2, max_decode_batch_size=4, max_prefill_prompts=4, max_seq_len=96, temperature=1.0,
                       params_dtype="float32", kv_cache_dtype="float32", min_prefill_bucket=8, max_turns=3,
                       max_new_tokens=10)


class ScriptedEnv:
    """Answers turn i with `observations[i]` (ids) until they run out, then ends with reward 1. Records every turn
    it saw, and may sleep or fail at a turn."""

    stop: tuple = ()

    def __init__(self, prompt, observations, delay_s=0.0, fail_at=None):
        self.prompt, self.observations, self.delay_s, self.fail_at = list(prompt), observations, delay_s, fail_at
        self.turns = []

    def reset(self):
        return list(self.prompt)

    def step(self, turn):
        self.turns.append(turn)
        time.sleep(self.delay_s)
        if turn.index == self.fail_at:
            raise RuntimeError("the tool crashed")
        if turn.index < len(self.observations) and not turn.last:
            return StepResult(self.observations[turn.index], 0.0, False)
        return StepResult(None, 1.0, True, "correct")


def _requests(tok, observations, n_prompts=3, k=2, **env_kw):
    texts = ["3 1 4 1 5>", "9 2 6>", "5 3 5 8 9 7 9>", "8 4 6>"][:n_prompts]
    reqs, envs = [], []
    for i, t in enumerate(texts):
        ids = tok.encode(t)
        e = [ScriptedEnv(ids, observations, **env_kw) for _ in range(k)]
        envs += e
        reqs.append(Request(Prompt(i, t, k), ids, e))
    return reqs, envs


def _teacher_forced(model, params, prompt, completion, temperature):
    full = np.concatenate([prompt, completion.tokens])
    lp = model.get_logprobs(params, jnp.asarray(full[None]), jnp.asarray([len(full)]), temperature=temperature)
    return np.asarray(lp)[0, len(prompt) - 1:]  # the logprob of completion token t sits at index t


def _feed_config(cfg, path, obs):
    """`path`: how continuations go back in. 'decode': every one fed by decode steps; 'extend': every one through
    the extend program; 'mixed': the shorter observation fed by decode steps, the longer through extend."""
    feeds = sorted({1 + len(o) for o in obs})  # a continuation is the turn's last token and the observation
    limit = {"decode": feeds[-1], "extend": 0, "mixed": feeds[0]}[path]
    assert path != "mixed" or len(feeds) > 1
    return dataclasses.replace(cfg, decode_feed_tokens=limit)


def _check_feed_path(eng, path):
    fed, extended = eng.stats.fed_tokens, eng.stats.extend_time
    assert (fed > 0) == (path in ("decode", "mixed")) and (extended > 0) == (path in ("extend", "mixed"))


@pytest.mark.parametrize("path", ["decode", "extend", "mixed"])
def test_a_multi_turn_trajectory_is_exactly_what_the_sampler_saw(model_params, tok, path):
    """Three turns with two observations in between: the sampled tokens' logprobs equal the trainer's teacher-forced
    ones over the whole trajectory (so the KV continued across turns is the history's), the observations are the
    environment's ids, forced and out of the loss, and each turn the environment saw is the sampled ids. Whichever
    way the observations went into the cache."""
    model, params = model_params
    obs = [tok.encode("=4>"), tok.encode("ok 7>")]
    reqs, envs = _requests(tok, obs)
    eng = Engine(model, params, _feed_config(BASE, path, obs), tok, seed=1)
    out = eng.generate(reqs)
    assert len(out) == 3 and all(len(r.completions) == 2 for r in out)
    checked = 0
    for r, group_envs in zip(sorted(out, key=lambda r: r.prompt.position), np.array_split(envs, 3)):
        for c, env in zip(r.completions, group_envs):
            assert c.n_turns == 3 and c.end_reason == "done" and c.reward == 1.0
            assert c.observation_tokens == sum(len(o) for o in obs)
            starts = np.nonzero(np.diff(np.concatenate([[0], c.observation.astype(int)])) == 1)[0]
            for o, s in zip(obs, starts):
                np.testing.assert_array_equal(c.tokens[s:s + len(o)], o)  # the environment's ids, as given
            assert c.forced[c.observation].all() and (c.logprobs[c.observation] == 0).all()
            # Each turn the environment saw is exactly the sampled ids of that turn.
            for turn in env.turns:
                seg = c.tokens[(c.turns == turn.index) & ~c.observation]
                np.testing.assert_array_equal(turn.tokens, seg)
            lp = _teacher_forced(model, params, r.prompt_tokens, c, BASE.temperature)
            sampled = ~c.forced
            np.testing.assert_allclose(c.logprobs[sampled], lp[sampled], atol=1e-4)
            checked += int(sampled.sum())
    assert checked > 50
    batch = build_batch(out, LossConfig(max_tokens=64))
    for b, (r, c) in enumerate((g, c) for g in out for c in g.completions):
        p = len(r.prompt_tokens)
        np.testing.assert_array_equal(batch.loss_mask[b, p:p + len(c.tokens)], ~c.forced)  # observations: no loss
    assert eng.stats.parked_full == 0
    _check_feed_path(eng, path)


@pytest.mark.parametrize("path", ["decode", "extend"])
def test_multi_turn_trajectories_stay_exact_on_a_dp_x_tp_replica(model_params, tok, path):
    """The whole path on a 2 x 2 mesh: a row's cache parked from a decode batch split over dp (the device that holds
    the row hands it to all), extended or fed by decode steps, and put back; every sampled token's logprob is the
    trainer's."""
    model, params = model_params
    obs = [tok.encode("=4>"), tok.encode("ok 7>")]
    reqs, _ = _requests(tok, obs, n_prompts=4, k=2)
    cfg = dataclasses.replace(_feed_config(BASE, path, obs), replica_mode="spmd", tp=2, max_parked_rows=8)
    (eng,) = ReplicaSet(model, params, cfg, tok, devices=jax.devices()[:4], seed=1).engines
    assert eng.mesh.shape == {"dp": 2, "tp": 2}
    out = eng.generate(reqs)
    assert sorted(r.prompt.position for r in out) == [0, 1, 2, 3]
    for r in out:
        for c in r.completions:
            assert c.n_turns == 3 and c.end_reason == "done"
            lp = _teacher_forced(model, params, r.prompt_tokens, c, BASE.temperature)
            np.testing.assert_allclose(c.logprobs[~c.forced], lp[~c.forced], atol=1e-4)
    assert eng.stats.park_time > 0 and eng.stats.parked_full == 0
    _check_feed_path(eng, path)


def test_a_full_park_store_falls_back_to_a_re_prefill_and_stays_exact(model_params, tok):
    model, params = model_params
    obs = [tok.encode("=4>")]
    reqs, _ = _requests(tok, obs, n_prompts=3, k=2, delay_s=0.05)
    eng = Engine(model, params, dataclasses.replace(BASE, max_parked_rows=1), tok, seed=1)
    out = eng.generate(reqs)
    assert eng.stats.parked_full > 0
    for r in out:
        for c in r.completions:
            assert c.n_turns == 2
            lp = _teacher_forced(model, params, r.prompt_tokens, c, BASE.temperature)
            np.testing.assert_allclose(c.logprobs[~c.forced], lp[~c.forced], atol=1e-4)


def test_limits_end_an_episode_cleanly_with_a_reason(model_params, tok):
    model, params = model_params
    never_done = [tok.encode("=1>")] * 10
    reqs, envs = _requests(tok, never_done, n_prompts=2)
    out = Engine(model, params, BASE, tok, seed=1).generate(reqs)
    for r in out:
        for c in r.completions:  # the environment never ends it: max_turns does, and the last turn said so
            assert c.end_reason == "done" and c.n_turns == BASE.max_turns
    assert all(e.turns[-1].last for e in envs)
    reqs, _ = _requests(tok, [tok.encode("x" * 12)], n_prompts=2)
    out = Engine(model, params, dataclasses.replace(BASE, max_observation_tokens=8), tok, seed=1).generate(reqs)
    assert {c.end_reason for r in out for c in r.completions} == {"obs_cap"}
    # An observation that does not fit the context with a token to spare ends the episode ("context"); a turn
    # that fills it is the last one, and the environment is told so.
    reqs, _ = _requests(tok, [tok.encode("y" * 50)] * 2, n_prompts=2)
    out = Engine(model, params, dataclasses.replace(BASE, max_seq_len=64), tok, seed=1).generate(reqs)
    assert {c.end_reason for r in out for c in r.completions} == {"context"}
    assert all(len(r.prompt_tokens) + len(c.tokens) <= 64 for r in out for c in r.completions)


def test_a_failing_environment_ends_its_episode_not_the_run(model_params, tok):
    model, params = model_params
    reqs, _ = _requests(tok, [tok.encode("=4>")], n_prompts=2, fail_at=1)
    out = Engine(model, params, BASE, tok, seed=1).generate(reqs)
    assert len(out) == 2
    for c in (c for r in out for c in r.completions):
        assert c.end_reason == "env_error" and c.reward == 0.0 and c.n_turns == 2


def test_environment_steps_run_off_the_decode_thread(model_params, tok):
    """A slow environment (0.4 s a step) holds only its own episodes: the engine decodes and emits the other groups
    meanwhile, and the total is not the sum of the waits."""
    model, params = model_params
    fast, _ = _requests(tok, [tok.encode("=1>")], n_prompts=2)
    slow_ids = tok.encode("8 4 6>")
    slow = Request(Prompt(9, "slow", 2), slow_ids, [ScriptedEnv(slow_ids, [tok.encode("=1>")], delay_s=0.4)
                                                     for _ in range(2)])
    eng = Engine(model, params, BASE, tok, seed=1)
    eng.generate([slow] + fast[:1], drain=True)  # compile everything first
    order = []
    t0 = time.perf_counter()
    eng.generate([slow] + fast, drain=True, on_group=lambda r: order.append(r.prompt.position))
    took = time.perf_counter() - t0
    assert order[-1] == 9, order  # the slow group, though first in, is emitted last
    assert took < 2 * 0.4 * 2 + 1.0  # two slow steps per episode, overlapped with each other and with decode


def test_stop_sequences_end_a_turn_and_stay_in_it(model_params, tok):
    model, params = model_params
    stops = [tuple(tok.encode(d)) for d in "0123456789"]  # any digit ends the turn
    reqs, _ = _requests(tok, [tok.encode("=4>")], n_prompts=3)
    out = Engine(model, params, BASE, tok, seed=1, stop=stops).generate(reqs)
    digits = {s[0] for s in stops}
    ended = [t for r in out for c in r.completions for t in c.turn_texts]
    stopped = [c for r in out for c in r.completions if c.finish_reason == "stop"]
    assert stopped, ended
    for c in stopped:  # the last turn ends on a digit, kept as sampled (not forced, not replaced by EOS)
        last = c.tokens[(c.turns == c.n_turns - 1) & ~c.observation]
        assert last[-1] in digits and not c.forced[-1] and c.logprobs[-1] < 0
        assert not any(t in digits for t in last[:-1])


def _continuation_matches_a_fresh_prefill(engine: Engine, model: Model, params, history, obs, path):
    """A parked row continued by `obs` vs one forward over the whole history: the next token's logits. `path`:
    'extend' (the extend program) or 'decode' (a decode call puts the row in a slot and its steps feed the
    observation but its last token)."""
    history, obs = np.asarray(history, np.int32), np.asarray(obs, np.int32)
    park = engine.parking.new_store()
    pre = engine.prefill([history])  # caches history[:-1]: a row that stopped after sampling history[-1]

    def put(park, pre):  # prefill row 0 into park row 2
        move = lambda d, s: jax.lax.dynamic_update_slice_in_dim(d, s[:, :1].astype(d.dtype), 2, axis=1)  # noqa: E731
        return KVCache(k=jax.tree.map(move, park.k, pre.kv.k), v=jax.tree.map(move, park.v, pre.kv.v),
                       length=park.length.at[2].set(pre.kv.length[0]))

    with jax.set_mesh(engine.mesh) if engine.mesh is not None else _nullcontext():
        park = jax.jit(put)(park, pre)
    engine.store.kv = park
    feed = np.concatenate([history[-1:], obs])
    if path == "extend":
        state = engine.store.extend(engine.params, 0, [2], [feed])
        row = 0
    else:
        engine.scheduler.state = engine.programs.new_state()
        padded = np.zeros((engine.F,), np.int32)
        padded[: len(feed)] = feed
        # Insert into a free slot and run len(feed) - 1 steps: they feed all but the observation's last token.
        state, packed = engine.layout.run(
            engine.programs.decode, np.int32(0), np.int32(0), np.int32(0), np.uint32(0), np.int32(0),
            np.int32(len(feed) - 1), np.bool_(False), np.int32(2), padded, np.int32(len(feed)),
            device=(engine.params, engine.scheduler.state, engine.scheduler.dummy_prefill(), engine.store.kv))
        row = int(np.argmax(np.asarray(state.active)))
        assert int(np.asarray(state.steps)) == len(feed) - 1
        np.testing.assert_array_equal(np.asarray(state.tokens)[row, len(history):len(history) + len(obs)], obs)
        assert np.asarray(state.forced)[row, len(history):len(history) + len(obs) - 1].all()
    length, next_token = np.asarray(state.kv.length)[row], np.asarray(state.next_token)[row]
    assert length == len(history) + len(obs) - 1 and next_token == obs[-1]

    def next_logits(params, kv, tok):
        logits, _ = engine.model.apply(params, tok[:, None], jnp.ones_like(tok), kv)
        return logits[:, 0]

    with jax.set_mesh(engine.mesh) if engine.mesh is not None else _nullcontext():
        got = np.asarray(jax.jit(next_logits)(engine.params, state.kv, state.next_token))[row]
    full = np.concatenate([history, obs])
    want = np.asarray(model.apply(params, jnp.asarray(full[None]), jnp.asarray([len(full)]))[0])[0, len(full) - 1]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("path", ["extend", "decode"])
def test_a_row_continued_after_an_observation_matches_a_fresh_prefill(model_params, tok, path):
    model, params = model_params
    eng = Engine(model, params, BASE, tok, seed=1)
    _continuation_matches_a_fresh_prefill(eng, model, params, tok.encode("3 1 4 1 5>9"), tok.encode("=4> and 7>"),
                                          path)


@pytest.mark.parametrize("path", ["extend", "decode"])
def test_a_row_continued_after_an_observation_matches_a_fresh_prefill_on_a_dp_x_tp_mesh(model_params, tok, path):
    model, params = model_params
    cfg = dataclasses.replace(BASE, replica_mode="spmd", tp=2)
    rs = ReplicaSet(model, params, cfg, tok, devices=jax.devices()[:4], seed=1)
    (eng,) = rs.engines
    assert eng.mesh.shape == {"dp": 2, "tp": 2}
    _continuation_matches_a_fresh_prefill(eng, model, params, tok.encode("9 2 6>3"), tok.encode("=5>"), path)


def test_a_weight_sync_between_turns_shows_in_the_versions_and_the_lag(model_params, tok):
    """New weights land while the environment steps: the first turn carries version 0, the observation's cache entries
    and the next turn version 1, and the completion's oldest version (what the lag counts) stays 0."""
    model, params = model_params
    eng = Engine(model, params, dataclasses.replace(BASE, max_turns=2), tok, seed=1)

    class SyncingEnv(ScriptedEnv):
        def step(self, turn):
            if turn.index == 0:
                eng.set_params(params, 1)  # a weight sync landing between turns
            return super().step(turn)

    ids = tok.encode("3 1 4>")
    out = eng.generate([Request(Prompt(0, "x", 2), ids, [SyncingEnv(ids, [tok.encode("=4>")]) for _ in range(2)])])
    for c in out[0].completions:
        assert c.n_turns == 2
        first = (c.turns == 0) & ~c.observation
        assert (c.versions[first] == 0).all()
        assert (c.versions[c.observation] == 1).all() and (c.versions[c.turns == 1] == 1).all()
        assert c.oldest_version == 0 and c.end_version == 1


def test_the_run_stops_turns_on_its_environments_stop_sequences(model_params, tok):
    """The stop sequences a run's environments name (texts or ids, on their `EnvironmentSpec`) reach the engine:
    `Environments.stop_sequences` is their union over the sources, encoded once."""
    from asyncrl.envs import Environments, EnvironmentSpec, Source
    from asyncrl.envs.lookup import LookupTask, build_lookup

    stopping = Source(LookupTask(label="tool"), EnvironmentSpec(task=build_lookup, episode=ScriptedEnv,
                                                                stop=("</t>", (7, 8))))
    plain = Source(LookupTask(label="plain"), EnvironmentSpec(task=build_lookup))
    envs = Environments([stopping, plain], tok, None, chat=False, step_timeout_s=1)
    assert envs.stop_sequences() == sorted([tuple(tok.encode("</t>")), (7, 8)])
    assert Environments([plain], tok, None, chat=False, step_timeout_s=1).stop_sequences() == []
    model, params = model_params
    eng = Engine(model, params, BASE, tok, seed=1, stop=envs.stop_sequences())
    assert tuple(tok.encode("</t>")) in eng.stop


@pytest.mark.parametrize("norm", ["token_mean", "seq_mean", "constant"])
def test_every_normaliser_counts_model_tokens_only(model_params, tok, norm):
    """On a batch of real multi-turn trajectories: observation tokens get zero weight, and each normaliser's
    denominator is made of model tokens (token mean: all of them; sequence mean: each row's; Dr.GRPO's constant:
    rows x the budget of model tokens)."""
    from asyncrl.train.advantages import loss_weights

    model, params = model_params
    obs = [tok.encode("=4> and more observation text>")]
    reqs, _ = _requests(tok, obs, n_prompts=2)
    out = Engine(model, params, dataclasses.replace(BASE, max_turns=2), tok, seed=1).generate(reqs)
    cfg = LossConfig(max_tokens=BASE.generation_budget, normalization=norm)
    batch = build_batch(out, cfg)
    w = np.asarray(loss_weights(jnp.asarray(batch.loss_mask), cfg))
    comps = [(r, c) for r in out for c in r.completions]
    assert all(c.observation_tokens > 0 for _, c in comps)
    model_tokens = np.array([int((~c.forced).sum()) for _, c in comps])
    for b, (r, c) in enumerate(comps):
        p = len(r.prompt_tokens)
        assert (w[b, p:p + len(c.tokens)][c.observation] == 0).all()
        nz = w[b][w[b] > 0]
        expect = {"token_mean": model_tokens.sum(), "seq_mean": model_tokens[b] * len(comps),
                  "constant": len(comps) * BASE.generation_budget}[norm]
        np.testing.assert_allclose(nz, 1.0 / expect, rtol=1e-6)
        assert len(nz) == model_tokens[b]


def test_extend_rows_come_in_rungs_rounded_to_the_data_axis(model_params, tok):
    """An extend pads its rows to a rung of 1, 2, 3, 4, 6, 8, ... (at most a third padding), capped at
    max_prefill_prompts; on a replica whose rows split over dp=2, to a multiple of 2 (a 1-row extend cannot split)."""
    model, params = model_params
    cfg = dataclasses.replace(BASE, max_prefill_prompts=8, max_decode_batch_size=8)
    eng = Engine(model, params, cfg, tok, seed=1)
    assert [eng.extend_rows(n) for n in range(1, 9)] == [1, 2, 3, 4, 6, 6, 8, 8]
    (spmd,) = ReplicaSet(model, params, dataclasses.replace(cfg, replica_mode="spmd", tp=2), tok,
                         devices=jax.devices()[:4], seed=1).engines
    assert spmd.mesh.shape["dp"] == 2
    assert [spmd.extend_rows(n) for n in range(1, 9)] == [2, 2, 4, 4, 6, 6, 8, 8]


def test_continuations_do_not_wait_while_the_park_store_is_nearly_full(model_params, tok):
    """A waiting continuation holds its park row. With fewer than max_prefill_prompts park rows free, the ready ones
    are extended at once, however long they may wait: a turn that ended meanwhile would find no room and re-prefill
    its whole history."""
    from asyncrl.inference.episodes import Continuation, Episode, Group
    from asyncrl.rollout import Rollout

    model, params = model_params
    cfg = dataclasses.replace(BASE, extend_wait_s=30.0, max_parked_rows=8, decode_feed_tokens=0)
    eng = Engine(model, params, cfg, tok, seed=1)
    eng.scheduler.state, eng.store.kv = eng.programs.new_state(), eng.parking.new_store()
    prompt = np.asarray(tok.encode("3 1 4>"), np.int32)
    group = Group(Rollout(prompt=Prompt(0, None, 2), prompt_tokens=prompt),
                  [Episode(None, len(prompt)) for _ in range(2)])
    feed = np.asarray(tok.encode("9=4>"), np.int32)
    eng.scheduler.in_flight = eng.B  # every slot busy: a wait would cost no decode step
    eng.driver.ready = [Continuation(group, k, feed, park=k) for k in range(2)]
    eng.store.free = [r for r in range(eng.Q) if r >= 2][: eng.P]  # exactly P free: room to wait
    eng.driver.launch_ready()
    assert eng.stats.extend_calls == 0 and len(eng.driver.ready) == 2
    eng.store.free.pop()  # one fewer than P free: they go now
    eng.driver.launch_ready()
    assert eng.stats.extend_calls == 1 and eng.stats.extend_rows == 2 and not eng.driver.ready
    assert sorted(eng.store.free)[:2] == [0, 1]  # their park rows are free again


def test_continuations_left_after_a_full_extend_wait_for_their_own_batch(model_params, tok):
    """While the decode batch is busy, continuations are extended max_prefill_prompts at a time: the ones left over
    after a full batch wait (up to extend_wait_s) for the next one rather than going as a small extend of their own;
    once their wait is up, or a slot would idle, they go."""
    from asyncrl.inference.episodes import Continuation, Episode, Group
    from asyncrl.rollout import Rollout

    model, params = model_params
    eng = Engine(model, params, dataclasses.replace(BASE, extend_wait_s=30.0, decode_feed_tokens=0), tok, seed=1)
    eng.scheduler.state, eng.store.kv = eng.programs.new_state(), eng.parking.new_store()
    prompt = np.asarray(tok.encode("3 1 4>"), np.int32)
    group = Group(Rollout(prompt=Prompt(0, None, 6), prompt_tokens=prompt),
                  [Episode(None, len(prompt)) for _ in range(6)])
    feed = np.asarray(tok.encode("9=4>"), np.int32)
    eng.driver.ready = [Continuation(group, k, feed, park=k) for k in range(6)]
    eng.store.free = [r for r in eng.store.free if r >= 6]
    eng.scheduler.in_flight = eng.B  # every slot busy: waiting costs no decode step
    eng.driver.launch_ready()
    assert eng.stats.extend_calls == 1 and eng.stats.extend_rows == eng.P == 4
    assert [c.k for c in eng.driver.ready] == [4, 5] and len(eng.scheduler.queue) == 4  # the two left over wait
    eng.driver.launch_ready()  # nothing new: they go on waiting
    assert eng.stats.extend_calls == 1 and len(eng.driver.ready) == 2
    for c in eng.driver.ready:
        c.ready_at -= 31.0  # their wait is up
    eng.driver.launch_ready()
    assert eng.stats.extend_calls == 2 and eng.stats.extend_rows == 6 and not eng.driver.ready
    assert sorted(q.target.k for q in eng.scheduler.queue) == list(range(6))  # each continuation queued once


def test_short_continuations_go_into_the_decode_batch_at_once_and_long_ones_through_extend(model_params, tok):
    """A continuation of at most decode_feed_tokens tokens is queued ahead of new prompts at once, holding its park
    row until a decode call takes its cache (no extend, no wait, even with every slot busy); a longer one waits to
    share an extend."""
    from asyncrl.inference.episodes import Continuation, Episode, Fed, Group, Queued, Target
    from asyncrl.rollout import Rollout

    model, params = model_params
    short, long = np.asarray(tok.encode("9=4>"), np.int32), np.asarray(tok.encode("9=4> and 7> and 1>"), np.int32)
    cfg = dataclasses.replace(BASE, extend_wait_s=30.0, max_parked_rows=8, decode_feed_tokens=len(short))
    eng = Engine(model, params, cfg, tok, seed=1)
    assert len(long) > len(short)
    eng.scheduler.state, eng.store.kv = eng.programs.new_state(), eng.parking.new_store()
    prompt = np.asarray(tok.encode("3 1 4>"), np.int32)
    group = Group(Rollout(prompt=Prompt(0, None, 3), prompt_tokens=prompt),
                  [Episode(None, len(prompt)) for _ in range(3)])
    eng.scheduler.queue.append(Queued("a prompt row", 0, Target(group, 2)))
    eng.scheduler.in_flight = eng.B  # every slot busy
    eng.driver.ready = [Continuation(group, 0, short, park=0), Continuation(group, 1, long, park=1)]
    eng.store.free = [r for r in eng.store.free if r >= 2]
    eng.driver.launch_ready()
    assert eng.stats.extend_calls == 0 and [c.k for c in eng.driver.ready] == [1]  # the long one waits
    head, target = eng.scheduler.queue[0].source, eng.scheduler.queue[0].target
    assert isinstance(head, Fed) and head.park == 0 and target == Target(group, 0) and len(eng.scheduler.queue) == 2
    np.testing.assert_array_equal(head.feed, short)
    assert 0 not in eng.store.free  # held until a decode call takes it
    assert group.episodes[0].parts[-1].observation  # recorded now; its versions come from the row
