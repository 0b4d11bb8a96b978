"""Sessions through the endpoint (`asyncrl/endpoint/sessions.py`): an agent's calls of one episode, with tool calls
and the history passed back as messages, trained token-exact. The trajectory is the server's samples plus the
observation ids it inserted, the parked cache is continued (no prefill after the first call), the sampler's
logprobs are the trainer's, and an edited history starts a new branch. Then agent functions named by import path, run
as a group's episodes, and the ways they fail."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np
import openai
import pytest

from asyncrl.endpoint.agents import AgentConfig, AgentRunner, resolve
from asyncrl.endpoint.chat import ChatFormat
from asyncrl.envs.chat import ObservationRenderer
from asyncrl.rollout import Prompt
from asyncrl.validate import ConfigError
from tests.endpoint_fixtures import CALL, CFG, TOOLS, served_tool_call_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    yield from served_tool_call_model(tmp_path_factory)


def _agent_calls(client, session, user, calls=3):
    """What an agent does: call, run the tool it was asked for, pass the whole history back."""
    messages, responses = [{"role": "user", "content": user}], []
    for i in range(calls):
        r = client.chat.completions.create(model="asyncrl", messages=messages, tools=TOOLS, logprobs=True,
                                           extra_body={"session_id": session})
        responses.append(r)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(i + 2)})
    return messages, responses


def test_a_session_is_trained_token_exact(setup):
    tok, model, params, server, client = setup
    stats = server.engine.stats
    messages, rs = _agent_calls(client, "s1", "Add one to 1, three times, with the tool.", calls=1)
    # The scheduler's one-time empty prefill (for decode calls that insert nothing) may come later: not a prompt.
    prefills = stats.prefill_calls + (server.engine.scheduler._dummy is None)
    # Continue the same history twice more, as the agent would.
    for i in range(2):
        r = client.chat.completions.create(model="asyncrl", messages=messages, tools=TOOLS, logprobs=True,
                                           extra_body={"session_id": "s1"})
        rs.append(r)
        msg = r.choices[0].message
        messages += [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": str(i + 3)}]
    assert stats.prefill_calls == prefills  # the later calls continued the parked cache: no prefill
    assert stats.fed_tokens + stats.extend_rows > 0
    assert [r.model_extra["branch"] for r in rs] == [0, 0, 0] and [r.model_extra["turn"] for r in rs] == [0, 1, 2]
    (rollout,) = server.sessions.end("s1", reward=1.0)
    (c,) = rollout.completions
    assert rollout.prompt.sample.id == "s1/0" and c.reward == 1.0 and c.n_turns == 3
    # Every trained id is what the server sampled plus the observation ids it inserted, in order.
    renderer = ObservationRenderer(tok, ("<|im_end|>",), tools=TOOLS)
    expect = list(rollout.prompt_tokens)
    assert rs[0].model_extra["prompt_token_ids"] == expect
    for k, r in enumerate(rs):
        assert r.model_extra["prompt_token_ids"] == expect
        turn = r.choices[0].model_extra["token_ids"]
        assert turn == tok.encode(CALL)
        expect += turn
        if k + 1 < len(rs):
            expect += renderer.after(turn, [messages[2 * k + 2]])
    np.testing.assert_array_equal(np.concatenate([rollout.prompt_tokens, c.tokens]), expect)
    assert c.observation.sum() > 0 and c.forced[c.observation].all()
    # Re-rendering the history (what a text pipeline trains on) changes the ids; the trajectory keeps the sampled.
    rerendered = ChatFormat(tok).prompt_ids(messages[:-1], TOOLS)
    assert rerendered != expect[: len(rerendered)] and '{"name": "add", "arguments": {"x": 1}}' in \
        tok.decode(rerendered, skip_special_tokens=False)
    # The trainer's teacher-forced logprobs are the sampler's at every sampled token (fp32).
    full = np.asarray(expect, np.int32)
    lp = np.asarray(model.get_logprobs(params, jnp.asarray(full[None]), jnp.asarray([len(full)]),
                                       temperature=CFG.temperature))[0, len(rollout.prompt_tokens) - 1:]
    np.testing.assert_allclose(c.logprobs[~c.forced], lp[~c.forced], atol=1e-4)
    sampled = np.concatenate([r.choices[0].model_extra["token_logprobs"] for r in rs])
    np.testing.assert_allclose(c.logprobs[~c.observation], sampled, atol=0)
    assert stats.parked_full == 0


def test_an_edited_history_starts_a_new_branch(setup):
    tok, _, _, server, client = setup
    messages, rs = _agent_calls(client, "s2", "Add one to 1.", calls=2)
    edited = [{"role": "user", "content": "Add one to 5."}] + messages[1:]
    r = client.chat.completions.create(model="asyncrl", messages=edited, tools=TOOLS, extra_body={"session_id": "s2"})
    assert [x.model_extra["branch"] for x in rs] == [0, 0] and r.model_extra["branch"] == 1
    assert r.model_extra["prompt_token_ids"] == ChatFormat(tok).prompt_ids(edited, TOOLS)  # a fresh render
    out = server.sessions.end("s2", reward=0.5)
    assert [o.prompt.sample.branch for o in out] == [0, 1]
    assert [o.completions[0].n_turns for o in out] == [2, 1] and all(o.completions[0].reward == 0.5 for o in out)


def test_a_session_call_asks_one_choice(setup):
    client = setup[-1]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="asyncrl", messages=[{"role": "user", "content": "x"}], n=2,
                                       extra_body={"session_id": "s3"})
    assert e.value.body["param"] == "n"


# ---- agents as environments (`asyncrl/endpoint/agents.py`) ---------------------------------------------------------

def test_an_agent_function_makes_a_group_of_sessions(setup):
    tok, _, _, server, _ = setup
    runner = AgentRunner(server, AgentConfig(fn="tests.endpoint_agents:add_three_times", timeout_s=120))
    r = runner.run_group(Prompt(0, "Add one to 1, three times.", 2))
    assert len(r.completions) == 2
    for c in r.completions:
        assert c.reward == 1.0 and c.end_reason == "done" and c.n_turns == 3 and c.observation_tokens > 0
        sampled = c.tokens[~c.observation]
        np.testing.assert_array_equal(sampled, tok.encode(CALL) * 3)  # three sampled tool calls, exactly
    assert tok.decode(r.prompt_tokens, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("fn, reason", [("raises", "agent_error"), ("hangs", "agent_timeout"),
                                        ("never_calls", "agent_no_call")])
def test_a_failing_agent_ends_its_episode_with_a_reason(setup, fn, reason):
    server = setup[3]
    runner = AgentRunner(server, AgentConfig(fn=f"tests.endpoint_agents:{fn}", timeout_s=2))
    r = runner.run_group(Prompt(1, "Add one to 1.", 1))
    (c,) = r.completions
    assert c.end_reason == reason and c.reward == 0.0


def test_an_agent_path_is_checked(setup):
    with pytest.raises(ConfigError, match="must be 'module.path:function'"):
        resolve("tests.endpoint_agents")
    with pytest.raises(ConfigError, match="cannot be imported"):
        resolve("tests.endpoint_agents:missing")


# ---- bounds and teardown (found in review) ---------------------------------------------------------------------------

def test_a_call_after_end_is_refused_and_opens_no_branch(setup):
    server, client = setup[3], setup[-1]
    _agent_calls(client, "s4", "Add one to 1.", calls=1)
    server.sessions.end("s4", reward=0.0)
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(model="asyncrl", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"session_id": "s4"})
    assert "s4" not in server.sessions.sessions and server.loop.sessions == 0


def test_idle_sessions_have_their_own_bound_and_are_forgotten(setup, monkeypatch):
    """Open sessions count against endpoint.max_sessions, never max_queued: idle ones cannot hold off plain requests.
    A session nobody ends is forgotten once its episode has been over for session_idle_s."""
    server, client = setup[3], setup[-1]
    store, loop = server.sessions, server.loop
    monkeypatch.setattr(loop, "max_sessions", 1)
    # 3 s: the 429 and the plain call below must come while "idle" is still open, also beside another test worker.
    monkeypatch.setattr(store, "idle_s", 3.0)
    _agent_calls(client, "idle", "Add one to 1.", calls=1)  # its episode now waits for a next call
    assert loop.sessions == 1 and loop.admitted == 0
    with pytest.raises(openai.RateLimitError) as e:
        _agent_calls(client, "other", "Add one to 2.", calls=1)
    assert "endpoint.max_sessions=1" in e.value.body["message"] and "other" not in store.sessions
    plain = client.chat.completions.create(model="asyncrl", messages=[{"role": "user", "content": "x"}])
    assert plain.choices[0].finish_reason in ("stop", "tool_calls")  # served beside the idle session
    (branch,) = store.sessions["idle"]
    branch.rollout.result(30)  # idle past session_idle_s: its episode ended ("session_idle")
    assert branch.rollout.result().completions[0].reason == "session_idle" and loop.sessions == 0
    time.sleep(3.1)
    _agent_calls(client, "later", "Add one to 3.", calls=1)  # a new session sweeps the forgotten one
    assert "idle" not in store.sessions and "later" in store.sessions
    store.end("later", 0.0)


def test_open_sessions_hold_no_environment_thread(setup):
    """An open session's episode waits for its agent's next call on a future, holding no engine thread: more open
    sessions than the engine has environment threads are all served (with a thread each, the first turn of the one
    past `inference.env_threads` waited for an open one to go idle, `endpoint.session_idle_s`)."""
    server, client = setup[3], setup[-1].with_options(timeout=30)
    n, before = server.engine.cfg.env_threads + 1, server.loop.sessions
    with ThreadPoolExecutor(n) as ex:  # every episode then waits for its agent's next call
        turns = list(ex.map(lambda i: _agent_calls(client, f"open{i}", "Add one to 1.", calls=1)[1][0], range(n)))
    assert all(t.choices[0].finish_reason == "tool_calls" for t in turns) and server.loop.sessions == before + n
    for i in range(n):
        server.sessions.end(f"open{i}", 0.0)
    assert server.loop.sessions == before


def test_renderers_are_bounded(setup, monkeypatch):
    server = setup[3]
    store = server.sessions
    monkeypatch.setattr(store, "MAX_RENDERERS", 1)
    store._renderer(server, TOOLS, "a")
    store._renderer(server, [], "b")
    assert list(store._renderers) == ["b"]


def test_an_agent_runner_shuts_its_pool_down(setup):
    runner = AgentRunner(setup[3], AgentConfig(fn="tests.endpoint_agents:never_calls", timeout_s=5))
    runner.close()
    (c,) = runner.run_group(Prompt(2, "x", 1)).completions
    assert c.end_reason == "agent_error" and "shut down" in c.env_info[0]["error"]


def test_a_hung_agent_does_not_stall_the_episodes_after_it(setup):
    """A timed-out agent's thread cannot be killed; it gives its worker's place back at the timeout, so the next
    episode starts at once instead of waiting for the hung one to return (with one worker, it would have waited)."""
    runner = AgentRunner(setup[3], AgentConfig(fn="tests.endpoint_agents:hangs", timeout_s=1, workers=1))
    (c,) = runner.run_group(Prompt(3, "x", 1)).completions
    assert c.end_reason == "agent_timeout" and runner.leaked == 1
    runner.fn = resolve("tests.endpoint_agents:never_calls")
    t0 = time.monotonic()
    (c,) = runner.run_group(Prompt(4, "x", 1)).completions
    assert c.end_reason == "agent_no_call" and time.monotonic() - t0 < 2.0  # the hung agent sleeps 3 s more
    deadline = time.monotonic() + 10
    while runner.leaked and time.monotonic() < deadline:  # its thread ends when it returns, and is counted out
        time.sleep(0.1)
    assert runner.leaked == 0


def test_an_agents_own_timeout_error_is_an_agent_error(setup):
    """On Python 3.11+ the wait's timeout and an agent's own TimeoutError are one class: an agent that raises it at
    once failed (agent_error), it did not run past agent.timeout_s (nothing leaked)."""
    runner = AgentRunner(setup[3], AgentConfig(fn="tests.endpoint_agents:hangs", timeout_s=30, workers=1))

    def raises(url, key, sample):
        raise TimeoutError("the agent's own socket timeout")

    runner.fn = raises
    t0 = time.monotonic()
    (c,) = runner.run_group(Prompt(5, "x", 1)).completions
    assert c.end_reason == "agent_error" and runner.leaked == 0 and time.monotonic() - t0 < 10


def test_session_env_timers_and_async_steps():
    """The idle timer holds its env weakly (an answered step's env is not kept alive for session_idle_s); a timer
    that fires after the answer does nothing; the engine's async-step wrapper turns a step_async that raises,
    returns a coroutine, or is cancelled into a failed future (the episode ends 'env_error', not the decode loop)."""
    import gc
    import weakref
    from concurrent.futures import Future
    from types import SimpleNamespace

    from asyncrl.endpoint.sessions import SessionEnv, _Command
    from asyncrl.inference.turns import EpisodeDriver

    timers = []
    env = SessionEnv([1, 2], 300.0, None, lambda s, fn: timers.append(fn))
    fut = env.step_async(None)
    assert not fut.done() and len(timers) == 1
    env.send(_Command(reward=1.0, reason="done"))
    assert fut.result(0).done and fut.result(0).reward == 1.0
    ref = weakref.ref(env)
    del env, fut
    gc.collect()
    assert ref() is None  # the pending timer did not keep it
    timers[0]()  # fires late, on a collected env: nothing happens

    env = SessionEnv([1], 300.0, None, lambda s, fn: timers.append(fn))
    fut = env.step_async(None)
    timers[-1]()  # unanswered: the step expires
    assert fut.result(0).reason == "session_idle"

    class Raises:
        def reset(self):
            return []

        def step_async(self, turn):
            raise ValueError("broken environment")

    class Coroutine(Raises):
        async def step_async(self, turn):
            return None

    class Cancelled(Raises):
        def step_async(self, turn):
            f: Future = Future()
            f.cancel()
            return f

    driver = SimpleNamespace()
    for env_cls, err in ((Raises, ValueError), (Coroutine, TypeError), (Cancelled, RuntimeError)):
        out = EpisodeDriver._step(driver, SimpleNamespace(env=env_cls()), None)
        with pytest.raises(err):
            out.result(1)
