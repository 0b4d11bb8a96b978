"""The textarena adapter (`asyncrl/tasks/textarena.py`, `asyncrl/envs/textarena.py`): scripted games against the
real package (a winning binary search, invalid moves as the game handles them, token-exact observations in the plain
and the chat format, seeded resets from many threads), the real engine playing GuessTheNumber with the tiny model
(the reward and end reason are the game's), the task's config, and the install hint when the package is missing."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pytest

pytest.importorskip("textarena")

from asyncrl.envs import Environments, Source, build_sources, build_task  # noqa: E402  # noqa: E402
from asyncrl.envs.textarena import (  # noqa: E402  # noqa: E402
    ENVIRONMENT,
    INSTALL_HINT,
    Game,
    TextArenaEnv,
    TextArenaTask,
    action_text,
    build_textarena,
    episode_reward,
)
from asyncrl.inference.config import InferenceConfig  # noqa: E402
from asyncrl.inference.engine import Engine, Request  # noqa: E402
from asyncrl.models import Model, preset  # noqa: E402
from asyncrl.models.tokenizer import Tokenizer  # noqa: E402
from asyncrl.rollout import Prompt, Turn  # noqa: E402
from asyncrl.tasks import TaskConfig, TaskSourceConfig  # noqa: E402
from asyncrl.validate import ConfigError  # noqa: E402
from tests.helpers import build_qwen3_tokenizer  # noqa: E402

GAME = "GuessTheNumber-v0"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    tok = Tokenizer.from_folder(build_qwen3_tokenizer(str(tmp_path_factory.mktemp("qwen3"))))
    model = Model(dataclasses.replace(preset("tiny"), vocab_size=tok.vocab_size))
    return tok, model, model.init_params(jax.random.PRNGKey(3))


def _open(task, tok, chat, index=0):
    sample = task.sample("train", 0, index)
    ids = tok.encode_prompt(sample.prompt, chat=chat)
    env = TextArenaEnv(ids, sample, None, 5.0, tok)
    return sample, env, env.reset()


def _turn(tok, text, index, end, last=False):
    """A model turn as the engine hands it over: the sampled ids (closed by `end`, or cut: no end) and their text."""
    return Turn(np.asarray(tok.encode(text) + end, np.int32), text, index, "eos" if end else "length", last)


def _reference_transcript(env_id, seed, actions):
    """textarena's own transcript (its default LLM observation wrapper) after `actions`."""
    import textarena as ta

    env = ta.make(env_id=env_id)
    env.reset(num_players=1, seed=seed)
    for a in actions:
        env.step(action=a)
    return env.get_observation()[1]


def _binary_search(tok, env, prompt_ids, end, decode_obs, cut_at=None):
    """Plays GuessTheNumber by bisection, reading each hint from the observation ids. Returns the step results,
    the actions and the trajectory (prompt, turns, observations)."""
    lo, hi, ids, actions, results = 1, 20, list(prompt_ids), [], []
    for i in itertools.count():
        guess = (lo + hi) // 2
        text = f"My guess: [{guess}]"
        turn = _turn(tok, text, i, [] if i == cut_at else end)
        res = env.step(turn)
        ids += list(turn.tokens)
        actions.append(text)
        results.append(res)
        if res.done:
            return results, actions, ids
        ids += list(res.observation)
        hint = decode_obs(res.observation)
        lo, hi = (guess + 1, hi) if "higher" in hint else (lo, guess - 1)


def test_a_binary_search_wins_with_the_games_reward_and_plain_observations_are_its_transcript(tok):
    task = TextArenaTask()
    sample, env, prompt_ids = _open(task, tok, chat=False)
    assert prompt_ids == tok.encode_prompt(sample.prompt, chat=False)
    results, actions, ids = _binary_search(tok, env, prompt_ids, [tok.eos_id], tok.decode)
    final = results[-1]
    assert final.reward == 1.0 and final.reason == "Congratulations! You guessed the correct number."
    assert final.info["game"] == GAME and final.info["game_reward"] == 1.0 and not final.info["invalid_move"]
    assert all(not r.done and r.reward == 0.0 for r in results[:-1]) and 2 <= len(results) <= 5
    # Token-exact: the trajectory, before the winning move, decodes to textarena's own transcript, with the cue.
    before = ids[: len(ids) - len(tok.encode(actions[-1])) - 1]
    game = _reference_transcript(GAME, sample.metadata["seed"], actions[:-1])
    assert tok.decode(before) == game.lstrip("\n") + "\n[Player] "
    # The same game played by textarena alone gives the same reward.
    ref = Game(GAME, sample.metadata["seed"])
    for a in actions:
        ref.act(a)
    assert ref.close()[0] == 1.0


def test_chat_observations_are_exactly_the_templates_ids(qwen3):
    """A user message cut from the chat template after each turn (closing a turn cut without `<|im_end|>`): the
    trajectory is, id for id, the template's rendering of the game as a conversation."""
    tok = qwen3[0]
    task = TextArenaTask(template="chat")
    # A game bisection takes at least 3 guesses at (10, then 5 or 15 are the first two), so the cut turn is answered.
    index = next(i for i in itertools.count() if Game(GAME, task.game_seed("train", 0, i)).base.game_number
                 not in (5, 10, 15))
    sample, env, prompt_ids = _open(task, tok, chat=True, index=index)
    (im_end,) = tok.encode("<|im_end|>")
    said = []
    results, actions, ids = _binary_search(tok, env, prompt_ids, [im_end], tok.decode, cut_at=1)
    assert results[-1].reward == 1.0 and len(results) >= 3, "the cut turn must be followed by an observation"
    for r in results[:-1]:
        text = tok.decode(r.observation, skip_special_tokens=False)
        said.append(re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, re.S).group(1))
    assert all(s.startswith("[GAME] The target number is ") for s in said)
    messages = [{"role": "user", "content": sample.metadata["opening"]}]
    for a, s in zip(actions, said):
        messages += [{"role": "assistant", "content": a}, {"role": "user", "content": s}]
    expect = tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    history = ids[: len(ids) - len(tok.encode(actions[-1])) - 1]  # before the winning move
    assert tok.decode(history, skip_special_tokens=False) == expect
    assert history == tok.encode(expect)  # the ids too, not only the text


def test_invalid_moves_are_handled_as_the_game_handles_them(tok, caplog):
    task = TextArenaTask()
    _, env, _ = _open(task, tok, chat=False)
    eos = [tok.eos_id]
    first = env.step(_turn(tok, "no idea", 0, eos))  # one invalid move is allowed: the game warns and goes on
    assert not first.done and "You attempted an invalid move" in tok.decode(first.observation)
    second = env.step(_turn(tok, "[21]", 1, eos))  # a second in a row ends the game, with the game's reward
    assert second.done and second.reward == 0.0 and second.reason.startswith("Invalid Move: Invalid move.")
    assert second.info["invalid_move"] and second.info["game_reward"] == 0.0
    # The last turn the engine allows ends an unfinished game: the game gave no reward.
    _, env, _ = _open(task, tok, chat=False, index=2)
    wrong = 1 if env.game.base.game_number != 1 else 2
    last = env.step(_turn(tok, f"[{wrong}]", 0, eos, last=True))
    assert last.done and last.reward == 0.0 and last.reason == "unfinished" and last.info["game_reward"] is None
    # A game that raises ends its episode with reward 0, logged, never the run.
    _, env, _ = _open(task, tok, chat=False, index=3)
    env.game.env.step = lambda action: 1 / 0
    with caplog.at_level(logging.WARNING, logger="asyncrl.envs.textarena"):
        res = env.step(_turn(tok, "[3]", 0, eos))
    assert res.done and res.reward == 0.0 and res.reason == "env_error" and "ZeroDivisionError" in res.info["error"]
    assert "failed at turn 0" in caplog.text
    # Rewards outside [0, 1] (a -1 for a game lost to invalid moves, a count) are clipped; thinking is not a move.
    assert [episode_reward(r) for r in (-1.0, 0.25, 3.0, None)] == [0.0, 0.25, 1.0, 0.0]
    assert action_text("<think>maybe [3]</think>\n\n[7]") == "[7]" and action_text("<think>[3] or") == ""


def test_seeded_resets_open_identically_from_eight_threads(tok):
    """textarena seeds the global `random` at reset and draws the hidden number from it: under the module's lock,
    resets racing on 8 threads still draw each seed's own game, and the process's own `random` is left alone."""
    task = TextArenaTask()
    samples = [task.sample("train", 0, i) for i in range(4)]
    ids = {s.id: tok.encode_prompt(s.prompt) for s in samples}
    serial = {s.id: Game(GAME, s.metadata["seed"]).base.game_number for s in samples}
    assert len(set(serial.values())) > 1  # the seeds pick different games

    def reset(s):
        env = TextArenaEnv(ids[s.id], s, None, 5.0, tok)
        return s.id, env.reset(), env.game.base.game_number

    random.seed(1234)
    expect_next = random.Random(1234).random()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so that unlocked resets would interleave (measured: they do)
    try:
        with ThreadPoolExecutor(8) as pool:
            out = list(pool.map(reset, samples * 128))
    finally:
        sys.setswitchinterval(interval)
    for sid, opened, number in out:
        assert opened == ids[sid] and number == serial[sid]
    assert random.random() == expect_next
    # Train and eval never share a game seed; eval is finite, train endless.
    train = [s.metadata["seed"] for s in itertools.islice(task.samples("train", 0), 50)]
    evals = [s.metadata["seed"] for s in task.samples("eval", 0)]
    assert len(evals) == task.eval_size and not set(train) & set(evals) and len(set(train)) == 50


def _check_games(out):
    """Each completion's reward and reason are what textarena alone gives for the same moves in the same game."""
    checked = 0
    for r in out:
        seed = r.prompt.sample.metadata["seed"]
        for c in r.completions:
            assert c.end_reason in ("done", "max_turns") and c.reward is not None
            ref = Game(GAME, seed)
            done = False
            for text in c.turn_texts:
                done, _ = ref.act(action_text(text))
            game_reward, end = ref.close()
            assert c.reward == episode_reward(game_reward)
            assert c.reason == (end.get("reason") if done else "unfinished")
            assert c.env_info[-1]["game"] == GAME and c.env_info[-1]["game_reward"] == game_reward
            assert c.forced[c.observation].all() and (c.observation_tokens > 0) == (c.n_turns > 1)
            checked += 1
    return checked


def test_the_engine_plays_guess_the_number_with_the_tiny_model(model_params, tok):
    """Plain prompts, the character tokenizer: whatever the random model writes, the game scores it."""
    model, params = model_params
    cfg = TaskConfig(sources=[TaskSourceConfig(environment="textarena", options={"eval_size": 2})])
    sources = build_sources(cfg)
    task = sources[0].task
    envs = Environments(sources, tok, None, chat=False, step_timeout_s=5.0)
    samples = list(itertools.islice(task.samples("train", 0), 2))
    reqs = [Request(Prompt(i, s, 2), *envs.open(s, 2)) for i, s in enumerate(samples)]
    icfg = InferenceConfig(group_size=2, max_decode_batch_size=4, max_prefill_prompts=2, max_seq_len=1024,
                           temperature=1.0, params_dtype="float32", kv_cache_dtype="float32", min_prefill_bucket=16,
                           max_turns=3, max_new_tokens=6)
    out = Engine(model, params, icfg, tok, seed=0).generate(reqs)
    assert len(out) == 2 and _check_games(out) == 4
    assert any(c.n_turns > 1 for r in out for c in r.completions)  # the first invalid move got the game's warning


def test_the_engine_plays_chat_games_token_exact(qwen3):
    """Chat prompts through Qwen3's template: the same, and every observation is the template's user turn."""
    tok, model, params = qwen3
    task = TextArenaTask(template="chat")
    envs = Environments([Source(task, ENVIRONMENT)], tok, None, chat=True, step_timeout_s=5.0)
    samples = [task.sample("train", 0, i) for i in range(2)]
    reqs = [Request(Prompt(i, s, 2), *envs.open(s, 2)) for i, s in enumerate(samples)]
    icfg = InferenceConfig(group_size=2, max_decode_batch_size=4, max_prefill_prompts=2, max_seq_len=384,
                           temperature=1.0, params_dtype="float32", kv_cache_dtype="float32", min_prefill_bucket=16,
                           max_turns=3, max_new_tokens=8)
    out = Engine(model, params, icfg, tok, seed=0).generate(reqs)
    assert _check_games(out) == 4
    for r in out:
        for c in r.completions:
            for t in range(c.n_turns - 1):
                obs = tok.decode(c.tokens[(c.turns == t) & c.observation], skip_special_tokens=False)
                assert re.fullmatch(r"(<\|im_end\|>)?\n<\|im_start\|>user\n\[GAME\] .*<\|im_end\|>\n"
                                    r"<\|im_start\|>assistant\n", obs, re.S), obs


def test_config_errors_name_the_field(tok):
    def build(**opts):
        return build_textarena(TaskSourceConfig(environment="textarena", options=opts), TaskConfig(), "task.sources[0]")

    assert build(env_ids=["GuessTheNumber-v0", "TowerOfHanoi-v0"], eval_size=3).eval_size == 3
    with pytest.raises(ConfigError, match=r"task.sources\[0\].options='max_turns' is invalid"):
        build(max_turns=3)
    with pytest.raises(ConfigError, match="'NoSuchGame-v0' is not a textarena game"):
        build(env_ids=["NoSuchGame-v0"])
    for two_player in ("TicTacToe-v0", "QuantumTicTacToe-v0"):  # one refuses 1 player, one plays it as 2
        with pytest.raises(ConfigError, match=f"{two_player}' cannot be opened as a single-player game"):
            build(env_ids=[two_player])
    with pytest.raises(ConfigError, match=r"task.sources\[0\].tools=True is invalid for environment 'textarena'"):
        build_task(TaskConfig(sources=[TaskSourceConfig(environment="textarena", tools=True)]))
    with pytest.raises(NotImplementedError, match="scored by the game itself"):
        TextArenaTask().score("[3]", TextArenaTask().sample("train", 0, 0))


def test_a_missing_package_gives_the_install_hint(monkeypatch, tok):
    sample = TextArenaTask().sample("train", 0, 0)
    monkeypatch.setitem(sys.modules, "textarena", None)  # `import textarena` now raises ImportError
    with pytest.raises(ImportError, match=re.escape(INSTALL_HINT)):
        build_textarena(TaskSourceConfig(environment="textarena"), TaskConfig(), "task.sources[0]")
    with pytest.raises(ImportError, match=re.escape(INSTALL_HINT)):
        TextArenaEnv(tok.encode(sample.prompt), sample, None, 5.0, tok).reset()
