"""Agent functions for the endpoint tests, named by import path as a user's would be (`agent.fn`)."""

from __future__ import annotations

import json
import threading
import time

from tests.endpoint_fixtures import TOOLS


def add_three_times(base_url, api_key, sample):
    """A tool-using agent written against the openai client: calls, runs each tool call, passes the history back."""
    client = sample.client(max_retries=0, timeout=120)
    messages = [{"role": "user", "content": sample.sample}]
    calls = 0
    for _ in range(3):
        r = client.chat.completions.create(model="asyncrl", messages=messages, tools=TOOLS)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        for c in msg.tool_calls or []:
            calls += 1
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": str(json.loads(c.function.arguments)["x"] + 1)})
    return 1.0 if calls == 3 else 0.0


def raises(base_url, api_key, sample):
    sample.client(max_retries=0).chat.completions.create(
        model="asyncrl", messages=[{"role": "user", "content": sample.sample}])
    raise RuntimeError("a bug in the agent")


def hangs(base_url, api_key, sample):
    time.sleep(4)
    return 1.0


def never_calls(base_url, api_key, sample):
    return 1.0


LOOKUP_TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Tell the hidden letter.",
                                                  "parameters": {"type": "object", "properties": {}}}}]
_HTTP: list = []
_HTTP_LOCK = threading.Lock()


def _http():
    """One connection pool for every episode's client (the openai client's own HTTP client, which is thread-safe):
    building one per client (its TLS context) costs more CPU than the two calls an episode makes here."""
    import openai

    with _HTTP_LOCK:
        if not _HTTP:
            _HTTP.append(openai.DefaultHttpxClient(timeout=120))
        return _HTTP[0]


def lookup_agent(base_url, api_key, sample):
    """The lookup task (`asyncrl/envs/lookup.py`) as an agent with a tool: the prompt is a random key, the `lookup`
    tool tells the hidden letter, and the agent's final answer (its last message's text) is graded by the task's
    verifier. At most two calls: the first may call the tool, whose result goes back as a `tool` message."""
    client = sample.client(max_retries=0, timeout=120, http_client=_http())
    messages = [{"role": "user", "content": sample.sample.prompt}]
    for _ in range(2):
        msg = client.chat.completions.create(model="asyncrl", messages=messages,
                                             tools=LOOKUP_TOOLS).choices[0].message
        if not msg.tool_calls:
            return msg.content or ""
        messages.append(msg.model_dump(exclude_none=True))
        for c in msg.tool_calls:
            result = sample.sample.answer if c.function.name == "lookup" else f"no tool {c.function.name!r}"
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
    return ""  # still calling at its last turn: no answer
