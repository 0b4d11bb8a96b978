"""Agent functions for the endpoint tests, named by import path as a user's would be (`agent.fn`)."""

from __future__ import annotations

import json
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
