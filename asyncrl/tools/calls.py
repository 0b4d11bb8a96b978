"""Tool calls in the formats that models produce through their chat templates, and the tool results they expect.

A model turn either calls tools or answers. `ToolCallFormat.parse(turn text)` returns the calls it made (each a
`ToolCall`, or a `CallError` the environment turns into an error observation: malformed JSON, an unknown tool,
missing or mistyped arguments), or [] when the turn makes no call. `result_messages` gives the chat messages that
carry a tool's result back; `asyncrl/envs/chat.py` renders them through the template, token-exact.

- Qwen3 (Hermes style): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, then `<|im_end|>`; the
  result goes back as the `tool` role, which the template wraps in `<tool_response>` inside a user turn.
- Llama 3.1: a custom (JSON) tool call is the whole turn, `{"name": ..., "parameters": {...}}` then `<|eot_id|>`;
  with the built-in code interpreter (`builtin_tools=["code_interpreter"]`, "Environment: ipython") the model
  writes `<|python_tag|>` and then Python source, ended by `<|eom_id|>`. The template also writes built-in calls as
  `<|python_tag|>name.call(arg="...")`, and models put JSON after the tag too: all three parse. Results go back as
  the `ipython` role.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call: its name, what it does, and its arguments as a JSON schema (the `parameters` of an
    OpenAI-style function, which both templates render)."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=dict)

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


PYTHON_TOOL = ToolSpec(
    "python",
    "Run Python 3 code and return what it prints (the value of a final expression is printed too). Standard "
    "library only, no network, no files outside a scratch directory, a few seconds of CPU.",
    {"type": "object", "properties": {"code": {"type": "string", "description": "The Python source to run."}},
     "required": ["code"]},
)

TOOLS: dict[str, ToolSpec] = {t.name: t for t in (PYTHON_TOOL,)}
"""The one list of tools: what `tools.tools` may name (`ToolsConfig`), and the specs episodes offer (`Toolbox`)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class CallError:
    """A call the environment cannot run. `kind`: "malformed_json", "unknown_tool", "missing_arguments",
    "bad_arguments"; `message`: what the model is told."""

    kind: str
    message: str


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict,
               "array": list}


def check_call(obj: Any, tools: Sequence[ToolSpec], args_key: str) -> ToolCall | CallError:
    """A decoded call object -> a `ToolCall` that names a known tool with its required arguments of the right JSON
    types, or the `CallError` that says what is wrong."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return CallError("malformed_json", f'a tool call must be a JSON object {{"name": ..., "{args_key}": {{...}}}}')
    by_name = {t.name: t for t in tools}
    name = obj["name"]
    if name not in by_name:
        return CallError("unknown_tool", f"unknown tool {name!r}; available: {', '.join(sorted(by_name))}")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return CallError("malformed_json", f"the arguments of {name} are not valid JSON: {e.msg}")
    if not isinstance(args, dict):
        return CallError("bad_arguments", f"the arguments of {name} must be a JSON object")
    schema = by_name[name].parameters
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return CallError("missing_arguments", f"{name} needs the argument(s) {', '.join(missing)}")
    for key, value in args.items():
        prop = schema.get("properties", {}).get(key)
        if prop is None:
            return CallError("bad_arguments", f"{name} has no argument {key!r}")
        kind = prop.get("type", "")
        ok = isinstance(value, _JSON_TYPES.get(kind, object))
        if not ok or (kind in ("integer", "number") and isinstance(value, bool)):  # JSON true is not a number
            return CallError("bad_arguments", f"{name}: argument {key!r} must be of type {kind}")
    return ToolCall(name, dict(args))


def _loads(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"


class ToolCallFormat:
    """How one model family writes tool calls and reads results. `stop`: texts that end a calling turn (the engine
    stops decoding there, so the model does not go on to imagine the result); `turn_end`: the tokens that end a
    model turn in the template (for `ObservationRenderer`)."""

    name = ""
    stop: tuple[str, ...] = ()
    turn_end: tuple[str, ...] = ()
    args_key = "arguments"

    def template_kwargs(self, tools: Sequence[ToolSpec]) -> dict[str, Any]:
        return {"tools": [t.schema() for t in tools]}

    def parse(self, text: str, tools: Sequence[ToolSpec]) -> list[ToolCall | CallError]:
        raise NotImplementedError

    def result_messages(self, call: ToolCall | CallError, result: str) -> list[dict[str, Any]]:
        return [{"role": "tool", "name": getattr(call, "name", "error"), "content": result}]


class Qwen3Format(ToolCallFormat):
    name = "qwen3"
    stop = ("</tool_call>",)
    turn_end = ("<|im_end|>",)
    _CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)

    def parse(self, text: str, tools: Sequence[ToolSpec]) -> list[ToolCall | CallError]:
        # A call written while thinking is not made: the engine stops at its </tool_call> all the same, so the block
        # is then unclosed, and everything after an unclosed <think> is thinking too.
        text = re.sub(r"<think>.*?(</think>|$)", "", text, flags=re.S)
        out: list[ToolCall | CallError] = []
        for m in self._CALL.finditer(text):
            if not m.group(2):
                out.append(CallError("malformed_json", "the tool call has no closing </tool_call>"))
                continue
            obj, err = _loads(m.group(1).strip())
            out.append(CallError("malformed_json", err) if err else check_call(obj, tools, self.args_key))
        return out


class Llama31Format(ToolCallFormat):
    name = "llama3.1"
    stop = ("<|eom_id|>",)
    turn_end = ("<|eot_id|>", "<|eom_id|>")
    args_key = "parameters"
    TAG = "<|python_tag|>"
    _BUILTIN = re.compile(r"^\s*([A-Za-z_]\w*)\.call\((.*)\)\s*$", re.S)

    def __init__(self, code_tool: str = "python") -> None:
        self.code_tool = code_tool  # the tool that runs raw code after <|python_tag|> (the code interpreter)

    def template_kwargs(self, tools: Sequence[ToolSpec]) -> dict[str, Any]:
        kw = super().template_kwargs([t for t in tools if t.name != self.code_tool])
        if not kw["tools"]:
            del kw["tools"]
        if any(t.name == self.code_tool for t in tools):
            kw["builtin_tools"] = ["code_interpreter"]
        return kw

    def _builtin(self, body: str, tools: Sequence[ToolSpec]) -> ToolCall | CallError:
        m = self._BUILTIN.match(body)
        try:
            call = ast.parse(f"f({m.group(2)})", mode="eval").body if m else None
            args = {k.arg: ast.literal_eval(k.value) for k in call.keywords} if call is not None else None
        except (SyntaxError, ValueError):
            args = None
        if m is None or args is None or call.args:
            return CallError("malformed_json", 'a built-in call must read name.call(arg="value", ...)')
        name = self.code_tool if m.group(1) == "code_interpreter" else m.group(1)
        return check_call({"name": name, "parameters": args}, tools, self.args_key)

    def parse(self, text: str, tools: Sequence[ToolSpec]) -> list[ToolCall | CallError]:
        for end in self.turn_end:
            text = text.replace(end, "")
        if self.TAG in text:
            body = text.split(self.TAG, 1)[1].strip()
            if body.startswith("{"):
                obj, err = _loads(body)
                return [CallError("malformed_json", err) if err else check_call(obj, tools, self.args_key)]
            if self._BUILTIN.match(body):
                return [self._builtin(body, tools)]
            if not any(t.name == self.code_tool for t in tools):
                return [CallError("unknown_tool", "no code interpreter is available")]
            return [check_call({"name": self.code_tool, "parameters": {"code": body}}, tools, self.args_key)]
        body = text.strip()
        if body.startswith("{") and '"name"' in body:  # a JSON custom call is the whole turn
            obj, err = _loads(body)
            return [CallError("malformed_json", err) if err else check_call(obj, tools, self.args_key)]
        return []

    def result_messages(self, call: ToolCall | CallError, result: str) -> list[dict[str, Any]]:
        return [{"role": "ipython", "content": result}]


FORMATS = {"qwen3": Qwen3Format, "llama3.1": Llama31Format}


def format_for(name: str, chat_template: str | None) -> ToolCallFormat:
    """The format called `name`, or with "auto" the one the chat template writes: `<tool_call>` (Qwen3, Hermes) or
    `<|python_tag|>` (Llama 3.1). A template that writes neither (SmolLM2's, or none at all) gets Qwen3's, with the
    tools described in the prompt (`ToolPrompt`)."""
    if name != "auto":
        if name not in FORMATS:
            raise ValueError(f"tools.format={name!r} is invalid: must be auto or one of {sorted(FORMATS)}")
        return FORMATS[name]()
    template = chat_template or ""
    if "<|python_tag|>" in template:
        return Llama31Format()
    return Qwen3Format()


def template_has_tools(chat_template: str | None) -> bool:
    """Whether the template renders a `tools=` list itself (else the tools go in the prompt's own text)."""
    return bool(chat_template) and "tools" in chat_template and ("<tool_call>" in chat_template
                                                                  or "<|python_tag|>" in chat_template)


def tools_instruction(tools: Sequence[ToolSpec]) -> str:
    """The Qwen3 template's own tool preamble, for templates that render no tools (and plain prompts): the model
    is told the same thing either way."""
    lines = "\n".join(json.dumps(t.schema()) for t in tools)
    return ("You may call one or more functions to assist with the user query.\n\nYou are provided with function "
            f"signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n</tools>\n\nFor each function call, "
            "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
