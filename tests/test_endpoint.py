"""The OpenAI-compatible endpoint (`asyncrl/endpoint/`) against a real server on loopback, called with the pinned
`openai` client: chat with tools (parsed into `tool_calls`), n > 1, logprobs (the trainer's teacher-forced ones),
streaming, `/v1/completions`, `/v1/models`, each error case by status and the field it names, and overload."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import jax.numpy as jnp
import numpy as np
import openai
import pytest

from asyncrl.endpoint.chat import ChatFormat
from asyncrl.endpoint.config import EndpointConfig
from asyncrl.models.tokenizer import Tokenizer
from asyncrl.validate import ConfigError
from tests.endpoint_fixtures import CALL, CFG, TOOLS, serve, served_tool_call_model, shutdown
from tests.helpers import build_llama31_tokenizer

USER = [{"role": "user", "content": "Add one to 1, with the tool."}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    yield from served_tool_call_model(tmp_path_factory)


def _teacher_forced(model, params, prompt, tokens):
    full = np.concatenate([prompt, tokens]).astype(np.int32)
    lp = model.get_logprobs(params, jnp.asarray(full[None]), jnp.asarray([len(full)]), temperature=CFG.temperature)
    return np.asarray(lp)[0, len(prompt) - 1:]


def test_chat_with_tools_n_and_logprobs(setup):
    tok, model, params, server, client = setup
    r = client.chat.completions.create(model="asyncrl", messages=USER, tools=TOOLS, n=2, logprobs=True)
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt == ChatFormat(tok).prompt_ids(USER, TOOLS)  # the template rendered the tools
    assert "<tools>" in tok.decode(prompt, skip_special_tokens=False)
    assert len(r.choices) == 2 and r.usage.prompt_tokens == len(prompt)
    for i, ch in enumerate(r.choices):
        assert ch.index == i and ch.finish_reason == "tool_calls"
        (call,) = ch.message.tool_calls
        assert call.type == "function" and call.function.name == "add"
        assert json.loads(call.function.arguments) == {"x": 1} and call.id.startswith("call_")
        ids = ch.model_extra["token_ids"]
        assert ids == tok.encode(CALL)  # the engine's samples, exactly
        # Standard logprobs are the extra field's, and both are the trainer's teacher-forced ones (the engine's path).
        lps = np.array([t.logprob for t in ch.logprobs.content])
        np.testing.assert_allclose(lps, ch.model_extra["token_logprobs"], atol=0)
        np.testing.assert_allclose(lps, _teacher_forced(model, params, prompt, ids), atol=1e-4)
        assert "".join(t.token for t in ch.logprobs.content) == CALL
        assert ch.model_extra["token_versions"] == [0] * len(ids) and not any(ch.model_extra["token_forced"])
    assert r.usage.completion_tokens == 2 * len(tok.encode(CALL))


def test_stream_gives_what_the_whole_answer_gives(setup):
    tok, _, _, _, client = setup
    whole = client.chat.completions.create(model="asyncrl", messages=USER, tools=TOOLS, seed=7)
    chunks = list(client.chat.completions.create(model="asyncrl", messages=USER, tools=TOOLS, seed=7, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    calls = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert calls[0].id == calls[0].id and calls[0].function.name == "add"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"x": 1}
    finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finish == ["tool_calls"] and chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    ids = [i for c in chunks for ch in c.choices for i in (ch.model_extra or {}).get("token_ids", [])]
    assert ids == whole.choices[0].model_extra["token_ids"]


def test_a_plain_chat_answers_in_content_and_tool_results_render(setup):
    tok, _, _, _, client = setup
    r = client.chat.completions.create(model="asyncrl", messages=USER, max_tokens=64)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == CALL.replace("<|im_end|>", "")
    # The call passed back as OpenAI gives it (arguments a JSON string), then its result: the template renders it.
    first = client.chat.completions.create(model="asyncrl", messages=USER, tools=TOOLS)
    history = USER + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "2"}]
    again = client.chat.completions.create(model="asyncrl", messages=history, tools=TOOLS)
    shown = tok.decode(again.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert '{"name": "add", "arguments": {"x": 1}}' in shown and "<tool_response>\n2\n</tool_response>" in shown


def test_completions_and_models(setup):
    tok, _, _, server, client = setup
    answered = server.metrics.requests
    assert [m.id for m in client.models.list()] == ["asyncrl"]
    prompt = tok.decode(ChatFormat(tok).prompt_ids(USER, []), skip_special_tokens=False)
    r = client.completions.create(model="asyncrl", prompt=prompt, logprobs=0)
    assert r.choices[0].text == CALL.replace("<|im_end|>", "")
    assert r.choices[0].logprobs.tokens[0] == "<tool_call>" and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="asyncrl", prompt=prompt, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert server.metrics.requests == answered + 3 and server.metrics.latency_s > 0  # the dashboard's figures


@pytest.mark.parametrize("kwargs, status, field", [
    ({"model": "gpt-9"}, 404, "model"),
    ({"n": 17}, 400, "n"),
    ({"temperature": 0.7}, 400, "temperature"),
    ({"max_tokens": 4}, 400, "max_tokens"),
    ({"top_logprobs": 3, "logprobs": True}, 400, "top_logprobs"),
    ({"tool_choice": "required", "tools": TOOLS}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x " * 400}]}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
])
def test_bad_requests_name_their_field(setup, kwargs, status, field):
    client = setup[-1]
    call = {"model": "asyncrl", "messages": USER, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**call)
    assert e.value.status_code == status
    assert e.value.body["param"] == field and e.value.body["message"].startswith(field), e.value.body


def test_malformed_json_is_a_400_naming_the_body(setup):
    server = setup[3]
    req = urllib.request.Request(f"{server.url}/chat/completions", data=b'{"model": "asyncrl", "messages": [',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    body = json.loads(e.value.read())
    assert e.value.code == 400 and body["error"]["param"] == "body" and "not valid JSON" in body["error"]["message"]


def test_overload_is_a_429_and_the_admitted_request_completes(setup):
    _, _, _, server, client = setup
    loop, engine = server.loop, server.engine
    gate, saved, results = threading.Event(), engine.between_loops, []
    engine.between_loops = lambda: gate.wait(60)  # hold the decode thread: admitted requests stay in flight
    loop.max_queued = 1
    try:
        t = threading.Thread(target=lambda: results.append(client.chat.completions.create(model="asyncrl",
                                                                                           messages=USER)))
        t.start()
        while loop.admitted < 1:
            t.join(0.01)
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model="asyncrl", messages=USER)
        assert e.value.status_code == 429 and "endpoint.max_queued=1" in e.value.body["message"]
    finally:
        loop.max_queued = EndpointConfig().max_queued
        gate.set()
        engine.between_loops = saved
    t.join(120)
    assert results and results[0].choices[0].finish_reason == "stop"


def test_a_non_loopback_address_needs_a_bearer_token(setup):
    with pytest.raises(ConfigError, match="endpoint.host='0.0.0.0' is invalid without endpoint.api_key"):
        EndpointConfig(host="0.0.0.0")
    EndpointConfig(host="0.0.0.0", api_key="secret")  # explicit address and token: accepted


def test_the_bearer_token_is_checked(setup):
    tok, model, params, _, _ = setup
    server = serve(model, params, tok, EndpointConfig(api_key="secret"))
    try:
        bad = openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=server.url, api_key="secret", max_retries=0)
        assert [m.id for m in good.models.list()] == ["asyncrl"]
    finally:
        shutdown(server)


def test_llama31_and_qwen3_turns_parse_into_tool_calls(setup, tmp_path):
    """The repo's formats (`tools/calls.py`) behind `tool_calls`: Llama 3.1's `<|python_tag|>` JSON and whole-turn
    JSON calls, and a Qwen3 call that does not parse stays in the content for the agent to read."""
    llama = Tokenizer.from_folder(build_llama31_tokenizer(str(tmp_path / "llama31")))
    chat = ChatFormat(llama)
    assert chat.format.name == "llama3.1"
    for text in ('<|python_tag|>{"name": "add", "parameters": {"x": 1}}<|eom_id|>',
                 '{"name": "add", "parameters": {"x": 1}}<|eot_id|>'):
        r = chat.reply(llama.encode(text), TOOLS, hit_length=False)
        assert r.finish_reason == "tool_calls" and r.content is None
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in r.tool_calls] == \
            [("add", {"x": 1})]
    plain = chat.reply(llama.encode("It is 2.<|eot_id|>"), TOOLS, hit_length=False)
    assert plain.content == "It is 2." and plain.tool_calls == [] and plain.finish_reason == "stop"
    qwen = ChatFormat(setup[0])
    bad = qwen.reply(setup[0].encode('<tool_call>{"name": "add"}</tool_call><|im_end|>'), TOOLS, hit_length=False)
    assert bad.tool_calls == [] and bad.content == '<tool_call>{"name": "add"}</tool_call>'
