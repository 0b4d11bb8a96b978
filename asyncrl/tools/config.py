"""The `tools` section of the run config: which tools the model may call, in which format, and the sandbox's limits.

Tools are used by the episodes of a task source whose `environment` is 'tools' (`asyncrl/envs/tool_use.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.tools.calls import TOOLS
from asyncrl.validate import check, check_choice

TOOL_FORMATS = ("auto", "qwen3", "llama3.1")


@dataclass(frozen=True)
class ToolsConfig:
    tools: list[str] = field(default_factory=lambda: ["python"])
    """The tools offered to the model, by name in `asyncrl.tools.calls.TOOLS` (their schemas go through
    `apply_chat_template(..., tools=...)`)."""
    format: str = "auto"
    """How calls are written: 'qwen3' (<tool_call> JSON), 'llama3.1' (<|python_tag|> and JSON calls), or 'auto':
    the one the chat template writes (Qwen3's for a template that writes none, with the tools in the prompt)."""
    workers: int = 4
    """Sandboxed calls run at once per inference host (a thread pool; each call is its own process)."""
    wall_s: float = 5.0
    """Wall-clock limit of one call: past it the call's process is killed and the model reads a timeout error."""
    cpu_s: int = 4
    """CPU seconds one call may use (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space one call may add (RLIMIT_AS): a larger allocation fails inside the call (MemoryError)."""
    output_bytes: int = 4096
    """What a call may print (stdout and stderr together); more is an 'output_limit' error, not a truncation."""
    max_calls_per_turn: int = 4
    """Calls run per model turn; more get an error observation each."""
    require_kernel_sandbox: bool = True
    """Refuse to run a call unless the kernel's layers (Landlock filesystem and network rules, a seccomp filter
    against fork, exec and sockets) are available. False: fall back to Python audit hooks, which are NOT a
    security boundary; for a laptop without Landlock only."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "tools") -> None:
        check(f"{where}.tools", list(self.tools), len(self.tools) > 0, "at least one tool")
        for i, name in enumerate(self.tools):
            check_choice(f"{where}.tools[{i}]", name, tuple(TOOLS))
        check_choice(f"{where}.format", self.format, TOOL_FORMATS)
        check(f"{where}.workers", self.workers, self.workers >= 1, ">= 1")
        check(f"{where}.wall_s", self.wall_s, self.wall_s > 0, "> 0")
        check(f"{where}.cpu_s", self.cpu_s, self.cpu_s >= 1, ">= 1")
        check(f"{where}.memory_mb", self.memory_mb, self.memory_mb >= 64, ">= 64")
        check(f"{where}.output_bytes", self.output_bytes, self.output_bytes >= 64, ">= 64")
        check(f"{where}.max_calls_per_turn", self.max_calls_per_turn, self.max_calls_per_turn >= 1, ">= 1")
