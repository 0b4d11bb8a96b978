"""Sessions through the endpoint (`asyncrl/endpoint/sessions.py`): an agent's calls of one episode, with tool calls
and the history passed back as messages, trained token-exact. The trajectory is the server's samples plus the
observation ids it inserted, the parked cache is continued (no prefill after the first call), the sampler's
logprobs are the trainer's, and an edited history starts a new branch. Then agent functions named by import path, run
as a group's episodes, and the ways they fail."""

from __future__ import annotations

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
