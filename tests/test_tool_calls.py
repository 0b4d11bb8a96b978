"""Tool calls in Qwen3's and Llama 3.1's formats, parsed from what their official chat templates render (the tokenizer
folders `tests/helpers.py` builds from packages: Qwen's and Llama 3's BPE, the templates trl ships); tool schemas
rendered through `tools=`; results rendered back as the template's tool role; bad calls as error observations."""

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest

from asyncrl.envs.tool_use import Toolbox, ToolEnv
from asyncrl.models.tokenizer import Tokenizer
from asyncrl.rollout import Turn
from asyncrl.tools.calls import (
    PYTHON_TOOL,
    TOOLS as REGISTERED,
    CallError,
    Llama31Format,
    Qwen3Format,
    ToolCall,
    ToolSpec,
    format_for,
    template_has_tools,
)
from asyncrl.tools.config import ToolsConfig
from tests.helpers import build_llama31_tokenizer, build_qwen3_tokenizer

WEATHER = ToolSpec("get_weather", "The weather in a city.",
                   {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"]})
TOOLS = [PYTHON_TOOL, WEATHER]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return Tokenizer.from_folder(build_qwen3_tokenizer(str(tmp_path_factory.mktemp("qwen3"))))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Tokenizer.from_folder(build_llama31_tokenizer(str(tmp_path_factory.mktemp("llama31"))))


def _assistant_text(tok, call, header, end, **kw):
    """What the template renders for an assistant turn that makes `call`: the model's own text for that call."""
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}]
    text = tok.hf.apply_chat_template(messages, tokenize=False, **kw)
    body = text[text.rindex(header) + len(header):]
    return body[:body.index(end) + len(end)]


def test_formats_are_found_from_the_templates(qwen3, llama):
    assert isinstance(format_for("auto", qwen3.hf.chat_template), Qwen3Format)
    assert isinstance(format_for("auto", llama.hf.chat_template), Llama31Format)
    assert template_has_tools(qwen3.hf.chat_template) and template_has_tools(llama.hf.chat_template)
    assert isinstance(format_for("auto", None), Qwen3Format)  # no template: the Qwen3 preamble in the prompt
    with pytest.raises(ValueError, match="tools.format='hermes'"):
        format_for("hermes", None)


def test_qwen3_calls_parse_from_the_template(qwen3):
    fmt = Qwen3Format()
    call = {"name": "python", "arguments": {"code": "print(123 * 456)"}}
    text = _assistant_text(qwen3, call, "<|im_start|>assistant\n", "<|im_end|>")
    assert "<tool_call>" in text and "</tool_call>" in text
    assert fmt.parse(text, TOOLS) == [ToolCall("python", {"code": "print(123 * 456)"})]
    two = text.replace("<|im_end|>", "") + "\n" + _assistant_text(
        qwen3, {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, "<|im_start|>assistant\n",
        "<|im_end|>")
    assert fmt.parse(two, TOOLS) == [ToolCall("python", {"code": "print(123 * 456)"}),
                                     ToolCall("get_weather", {"city": "Paris", "days": 2})]
    assert fmt.parse("The answer is 56088.", TOOLS) == []
    # A call written inside the thinking block is not made: closed, or cut at its </tool_call> by the engine.
    assert fmt.parse("<think><tool_call>\n" + json.dumps(call) + "\n</tool_call></think>56088", TOOLS) == []
    assert fmt.parse("<think>Let me compute.\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>", TOOLS) == []
    assert fmt.parse("<think>ok</think>\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>", TOOLS) != []


def test_qwen3_tools_and_results_go_through_the_template(qwen3):
    box = Toolbox(ToolsConfig(), qwen3, chat=True)
    prompt = qwen3.decode(box.prompt_ids("What is 123 * 456?"), skip_special_tokens=False)
    assert "<tools>" in prompt and json.dumps(PYTHON_TOOL.schema()) in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is 123 * 456?<|im_end|>\n<|im_start|>assistant\n")
    # A turn stopped on </tool_call> lacks <|im_end|>: the observation closes it, then the template's tool turn.
    turn = qwen3.encode('<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call>')
    calls = box.format.parse(qwen3.decode(turn), box.tools)
    obs = box.observation(turn, calls, ["42"])
    assert qwen3.decode(obs, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # The trajectory is what the template renders for the same conversation (token-exact, no re-encoding drift).
    history = [{"role": "user", "content": "What is 123 * 456?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"type": "function", "function": {"name": "python", "arguments": {"code": "print(6*7)"}}}]},
               {"role": "tool", "content": "42"}]
    want = qwen3.hf.apply_chat_template(history, tokenize=False, add_generation_prompt=True,
                                        tools=[PYTHON_TOOL.schema()])
    got = qwen3.decode(box.prompt_ids("What is 123 * 456?") + list(turn) + obs, skip_special_tokens=False)
    assert got == want


def test_llama31_calls_parse_from_the_template(llama):
    fmt = Llama31Format()
    # A custom tool: the template writes the bare JSON call; the model ends it with <|eot_id|>.
    text = _assistant_text(llama, {"name": "get_weather", "arguments": {"city": "Oslo"}},
                           "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")
    assert text.startswith('{"name": "get_weather", "parameters":')
    assert fmt.parse(text, TOOLS) == [ToolCall("get_weather", {"city": "Oslo"})]
    # The code interpreter (a built-in tool): the template writes <|python_tag|>name.call(...) and <|eom_id|> ...
    text = _assistant_text(llama, {"name": "code_interpreter", "arguments": {"code": "print(1+1)"}},
                           "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eom_id|>",
                           builtin_tools=["code_interpreter"])
    assert text.startswith("<|python_tag|>code_interpreter.call(")
    assert fmt.parse(text, TOOLS) == [ToolCall("python", {"code": "print(1+1)"})]
    # ... and the model itself writes the code after the tag, or a JSON call.
    assert fmt.parse("<|python_tag|>x = 6\nprint(x * 7)<|eom_id|>", TOOLS) == [
        ToolCall("python", {"code": "x = 6\nprint(x * 7)"})]
    assert fmt.parse('<|python_tag|>{"name": "python", "parameters": {"code": "1"}}', TOOLS) == [
        ToolCall("python", {"code": "1"})]
    assert fmt.parse("It is 42.", TOOLS) == []


def test_llama31_tools_and_results_go_through_the_template(llama):
    box = Toolbox(ToolsConfig(), llama, chat=True)
    prompt = llama.decode(box.prompt_ids("What is 6 * 7?"), skip_special_tokens=False)
    assert "Environment: ipython" in prompt  # python is the built-in code interpreter
    turn = llama.encode("<|python_tag|>print(6*7)") + llama.encode("<|eom_id|>")
    calls = box.format.parse(llama.decode(turn, skip_special_tokens=False), box.tools)
    assert calls == [ToolCall("python", {"code": "print(6*7)"})]
    obs = llama.decode(box.observation(turn, calls, ["42"]), skip_special_tokens=False)
    assert obs.startswith("<|start_header_id|>ipython<|end_header_id|>\n\n") and "42" in obs
    assert obs.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("fmt, text, kind", [
    (Qwen3Format(), '<tool_call>\n{"name": "python", "arguments": {"code": "1"\n</tool_call>', "malformed_json"),
    (Qwen3Format(), '<tool_call>\n{"name": "python", "arguments": {"code": "1"}}', "malformed_json"),  # unclosed
    (Qwen3Format(), '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>', "unknown_tool"),
    (Qwen3Format(), '<tool_call>\n{"name": "python", "arguments": {}}\n</tool_call>', "missing_arguments"),
    (Qwen3Format(), '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>', "bad_arguments"),
    (Qwen3Format(), '<tool_call>\n["python"]\n</tool_call>', "malformed_json"),
    (Llama31Format(), '{"name": "get_weather", "parameters": {"city": "Oslo"', "malformed_json"),
    (Llama31Format(), '{"name": "weather", "parameters": {"city": "Oslo"}}', "unknown_tool"),
    (Llama31Format(), '{"name": "get_weather", "parameters": {"days": 2}}', "missing_arguments"),
    (Llama31Format(), '<|python_tag|>get_weather.call(city=Oslo)', "malformed_json"),
    (Llama31Format(), '{"name": "get_weather", "parameters": {"city": "Oslo", "days": true}}', "bad_arguments"),
])
def test_bad_calls_are_named_errors(fmt, text, kind):
    (err,) = fmt.parse(text, TOOLS)
    assert isinstance(err, CallError) and err.kind == kind, err
    assert err.message


class _Verifier:
    """The task's grading, inline: exact match of the last integer."""

    def submit(self, text, sample):
        import re
        from concurrent.futures import Future

        f = Future()
        nums = re.findall(r"-?\d+", text)
        ok = bool(nums) and nums[-1] == sample.answer
        f.set_result(SimpleNamespace(reward=float(ok), reason="correct" if ok else "wrong"))
        return f


def _turn(tok, text, index=0, last=False):
    return Turn(np.asarray(tok.encode(text), np.int32), text, index, "stop", last)


def test_an_episode_calls_the_sandbox_reads_errors_and_answers(qwen3):
    box = Toolbox(ToolsConfig(wall_s=3.0, workers=2), qwen3, chat=True)
    try:
        env = ToolEnv(box.prompt_ids("What is 123 * 456?"),
                      SimpleNamespace(prompt="What is 123 * 456?", answer="56088", id="t/0"), _Verifier(), 30,
                      qwen3, box)
        assert env.reset() == box.prompt_ids("What is 123 * 456?")
        call = lambda code: '<tool_call>\n' + json.dumps({"name": "python", "arguments": {"code": code}}) + \
            '\n</tool_call>'  # noqa: E731
        res = env.step(_turn(qwen3, call("123 * 456")))
        assert not res.done and "56088" in qwen3.decode(res.observation)
        assert res.info["tools"][0]["error"] is None and res.info["tools"][0]["name"] == "python"
        # Hostile or broken calls: error observations, the episode goes on.
        for code, kind in [("while True: pass", ("timeout", "cpu_limit")), ("import os\nwhile True: os.fork()",
                                                                            ("forbidden", "exception"))]:
            res = env.step(_turn(qwen3, call(code), 1))
            assert not res.done and res.info["tools"][0]["error"] in kind, res.info
            assert "Error" in qwen3.decode(res.observation) or "rror" in qwen3.decode(res.observation)
        res = env.step(_turn(qwen3, '<tool_call>\n{"name": "python"}\n</tool_call>', 2))
        assert not res.done and res.info["tools"][0]["error"] == "missing_arguments"
        assert "missing_arguments" in qwen3.decode(res.observation)
        # A call on the last turn cannot be answered; an answer is graded.
        assert env.step(_turn(qwen3, call("1"), 3, last=True)).reason == "no_answer"
        res = env.step(_turn(qwen3, "The product is 56088.", 4))
        assert res.done and res.reward == 1.0
    finally:
        box.close()


def test_too_many_calls_in_one_turn_get_an_error_each(qwen3):
    box = Toolbox(ToolsConfig(max_calls_per_turn=1, workers=2), qwen3, chat=True)
    try:
        out = box.run([ToolCall("python", {"code": "print(1)"}), ToolCall("python", {"code": "print(2)"})])
        assert out[0][0].strip() == "1" and out[0][1] is None
        assert out[1][1] == "too_many_calls"
    finally:
        box.close()


def test_the_tools_the_config_accepts_are_the_ones_episodes_offer(qwen3):
    """One list of tools (`calls.TOOLS`): the config validates names against it and the toolbox takes specs from it."""
    assert REGISTERED == {"python": PYTHON_TOOL}
    box = Toolbox(ToolsConfig(tools=list(REGISTERED), require_kernel_sandbox=False), qwen3, chat=True)
    assert box.tools == list(REGISTERED.values())
    with pytest.raises(ValueError, match=r"tools\.tools\[1\]='shell'.*python"):
        ToolsConfig(tools=["python", "shell"])


def test_tool_metrics_count_calls_errors_latency_and_episodes():
    from asyncrl.orchestration.collect import episode_metrics, tool_metrics

    def comp(*steps):
        return SimpleNamespace(env_info=[{"tools": list(s)} for s in steps], tokens=np.zeros(3), n_turns=len(steps) + 1,
                               observation_tokens=0, env_s=0.0, end_reason="done")

    ok = {"name": "python", "error": None, "latency_s": 0.1}
    late = {"name": "python", "error": "timeout", "latency_s": 0.5}
    bad = {"name": None, "error": "malformed_json", "latency_s": 0.0}
    odd = {"name": "python", "error": "weird", "latency_s": 0.0}
    m = tool_metrics([comp([ok], [late, bad]), comp(), comp([ok, odd])])
    assert m["tools/calls"] == 5 and m["tools/calls_per_episode_mean"] == 5 / 3
    assert m["tools/episode_share_mean"] == pytest.approx(2 / 3)
    assert m["tools/latency_s_mean"] == pytest.approx(0.7 / 5)
    assert m["tools/errors"] == 3 and m["tools/error_timeout"] == 1 and m["tools/error_malformed_json"] == 1
    assert m["tools/error_other"] == 1
    # The same keys whatever happened (trainer hosts combine metrics by position), zeros when nothing did.
    none = tool_metrics([comp(), comp()])
    assert sorted(none) == sorted(m) and not any(none.values())
    assert "tools/calls" in episode_metrics([comp([ok])], tools=True)
    assert "tools/calls" not in episode_metrics([comp([ok])])  # a run without tools has no tool metrics


def test_a_source_with_tools_plays_tool_episodes_and_a_multi_turn_one_refuses_them(qwen3):
    from asyncrl.envs import Environments, build_sources
    from asyncrl.tasks.config import TaskConfig, TaskSourceConfig
    from asyncrl.validate import ConfigError

    src = dict(environment="reasoning_gym", options={"dataset": "products", "min_digits": 3, "max_digits": 3})
    sources = build_sources(TaskConfig(sources=[TaskSourceConfig(**src, tools=True)], eval_size=4))
    assert [s.tools for s in sources] == [True]
    envs = Environments(sources, qwen3, None, chat=True, step_timeout_s=5)
    sample = next(iter(sources[0].task.samples("train", 0)))
    ids, opened = envs.open(sample, 2)
    assert "<tools>" in qwen3.decode(ids, skip_special_tokens=False) and len(opened) == 2
    assert all(isinstance(e, ToolEnv) for e in opened)
    assert envs.stop_sequences() == [tuple(qwen3.encode("</tool_call>"))]  # the run's format's, not every format's
    # The format warm-start lays a mixture's examples out per source: the tool source's with the tools offered.
    from asyncrl.envs import combine
    from asyncrl.envs.tool_use import ToolWarmstart

    cfg = TaskConfig(sources=[TaskSourceConfig(**src, tools=True),
                              TaskSourceConfig(environment="reasoning_gym", options={"dataset": "chain_sum",
                                                                                     "label": "plain"})], eval_size=4)
    sources = build_sources(cfg)
    warm = ToolWarmstart(combine(sources, cfg), envs.toolbox, {s.task.label for s in sources if s.tools})
    examples = warm.warmstart_examples(qwen3, 8, 0, chat=True)
    offered = ["<tools>" in qwen3.decode(ids, skip_special_tokens=False) for ids, _ in examples]
    assert offered == [s.metadata["task"] == "products" for s in itertools.islice(warm.samples("train", 0), 8)]
    assert any(offered) and not all(offered)
    with pytest.raises(ConfigError, match=r"task.sources\[0\].tools=True is invalid for environment 'lookup'"):
        build_sources(TaskConfig(sources=[TaskSourceConfig(environment="lookup", tools=True)]))
    with pytest.raises(ConfigError, match=r"task.sources\[0\].environment"):
        TaskConfig(sources=[TaskSourceConfig(environment="")])


def test_llama31_episode_reads_the_call_from_the_sampled_ids(llama):
    """The engine's `Turn.text` drops special tokens (<|python_tag|> is one): the call is parsed from the ids."""
    box = Toolbox(ToolsConfig(wall_s=3.0, workers=1), llama, chat=True)
    try:
        ids = llama.encode("<|python_tag|>print(6*7)") + llama.encode("<|eom_id|>")
        text = llama.decode(ids)  # what the engine gives the environment as text
        assert "<|python_tag|>" not in text
        env = ToolEnv(box.prompt_ids("6*7?"), SimpleNamespace(prompt="6*7?", answer="42", id="t/1"), _Verifier(), 30,
                      llama, box)
        env.reset()
        res = env.step(Turn(np.asarray(ids, np.int32), text, 0, "stop", False))
        assert not res.done and res.info["tools"][0]["error"] is None, res
        assert "42" in llama.decode(res.observation)
    finally:
        box.close()


def test_a_format_that_contradicts_the_template_fails_at_start(qwen3):
    with pytest.raises(ValueError, match="tools.format='llama3.1'"):
        Toolbox(ToolsConfig(format="llama3.1"), qwen3, chat=True)
