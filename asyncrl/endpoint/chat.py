"""Chat messages to prompt ids through the tokenizer's template, and a sampled turn back to an assistant message
with OpenAI `tool_calls`, parsed by the repo's tool-call formats (`asyncrl/tools/calls.py`: Qwen3, Llama 3.1)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.models.tokenizer import Tokenizer
from asyncrl.tools.calls import (
    CallError,
    ToolCall,
    ToolCallFormat,
    ToolSpec,
    format_for,
    template_has_tools,
    tools_instruction,
)


@dataclass
class Reply:
    """A sampled turn as the API gives it back."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str  # "stop", "length" or "tool_calls"


def specs(tools: Sequence[dict[str, Any]]) -> list[ToolSpec]:
    return [ToolSpec(t["function"]["name"], t["function"].get("description", ""),
                     t["function"].get("parameters") or {}) for t in tools]


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: a tool call's `arguments` as an object (OpenAI sends a JSON string,
    on which Qwen's templates call `.items()`: a crash or a desync, AReaL#1420), content never None."""
    out = []
    for m in messages:
        m = dict(m)
        m["content"] = m.get("content") or ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c["function"])
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass  # rendered as the model wrote it
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


class ChatFormat:
    """One tokenizer's chat rendering and tool-call format. A template that renders `tools=` gets them there; any
    other carries the Qwen3 tool preamble as a system message, as the built-in tool environment does."""

    def __init__(self, tokenizer: Tokenizer, tool_format: str = "auto"):
        self.tokenizer = tokenizer
        template = tokenizer.hf.chat_template if tokenizer.has_chat_template else None
        if template is None:
            raise ValueError("the chat endpoint needs a tokenizer with a chat template")
        self.format: ToolCallFormat = format_for(tool_format, template)
        self.native = template_has_tools(template)
        # Texts that end a model turn, stripped from the content the agent reads (the ids keep them).
        self.turn_end = tuple(self.format.turn_end) + (tokenizer.hf.convert_ids_to_tokens(tokenizer.eos_id),)

    def template_kwargs(self, tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {"tools": list(tools)} if tools and self.native else {}

    def with_tools(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict]:
        msgs = template_messages(messages)
        if tools and not self.native:
            msgs = [{"role": "system", "content": tools_instruction(specs(tools))}] + msgs
        return msgs

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> str:
        return self.tokenizer.hf.apply_chat_template(self.with_tools(messages, tools), tokenize=False,
                                                     add_generation_prompt=True, **self.template_kwargs(tools))

    def prompt_ids(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[int]:
        return self.tokenizer.encode(self.render(messages, tools))

    def turn_text(self, tokens: Sequence[int]) -> str:
        """The turn's text with special tokens kept (Llama's `<|python_tag|>` is one), less the turn-end token."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        for end in self.turn_end:
            if text.endswith(end):
                return text[: -len(end)]
        return text

    def reply(self, tokens: Sequence[int], tools: Sequence[dict[str, Any]], hit_length: bool) -> Reply:
        """The assistant message of a sampled turn: its tool calls in OpenAI's form when every call parsed against
        the request's tools; a call that does not parse stays in the content, for the agent to see."""
        text = self.turn_text(tokens)
        calls = self.format.parse(text, specs(tools)) if tools else []
        if calls and all(isinstance(c, ToolCall) for c in calls):
            content = self._strip_calls(text)
            tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                           "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                          for c in calls if not isinstance(c, CallError)]
            return Reply(content or None, tool_calls, "tool_calls")
        return Reply(self._clean(text), [], "length" if hit_length else "stop")

    def _clean(self, text: str) -> str:
        for special in self.tokenizer.hf.all_special_tokens:  # removed as text: the ids are never re-encoded
            text = text.replace(special, "")
        return text

    def _strip_calls(self, text: str) -> str:
        if self.format.name == "qwen3":
            text = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S)
        else:
            text = text.split("<|python_tag|>", 1)[0] if "<|python_tag|>" in text else ""
        return self._clean(text).strip()
