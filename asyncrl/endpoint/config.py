"""The `endpoint` section (where the OpenAI-compatible server listens, who may call it, and its bounds) and the
`agent` section (the function that plays `environment: agent` sources through it)."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.validate import ConfigError, check, check_choice

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class EndpointConfig:
    host: str = "127.0.0.1"
    """Address the server binds. Loopback by default: the agents run on the same host. Any other address serves
    the policy to the network, so it requires `api_key`."""
    port: int = 0
    """TCP port; 0 takes a free one (the server reports its URL)."""
    api_key: str | None = None
    """Bearer token every request must carry (`Authorization: Bearer <key>`). None: no check, loopback only."""
    model: str = "asyncrl"
    """The model name requests must give (`GET /v1/models` lists it)."""
    max_queued: int = 64
    """Requests admitted at once (waiting for the engine or decoding). One more is answered 429 at once rather
    than queued without bound: an agent's client retries, the engine is never flooded."""
    max_sessions: int = 64
    """Sessions' episodes open at once (a session's branch holds one from its first call until its agent's episode
    ends, or `session_idle_s` after its last call). Counted apart from `max_queued`, so that idle sessions cannot
    hold off plain requests; one more is answered 429. A run's agents need one each: at least `agent.workers`."""
    max_n: int = 16
    """Largest `n` (choices per request): a group of n samples takes n decode rows."""
    request_timeout_s: float = 600.0
    """How long a request may wait for its completion before it is answered 504."""
    session_idle_s: float = 300.0
    """How long a session's episode waits for the agent's next call (holding its cache while the park store has room;
    no thread) before it ends with reason 'session_idle'."""
    strict_sampling: bool = True
    """The decode program samples at the run's temperature, with its per-turn cap and stop sequences: the trainer's
    logprobs assume exactly that. True: a request asking for other `temperature`, `top_p`, a smaller `max_tokens`
    or other `stop` gets a 400 naming the field. False: those fields are accepted and the run's values used."""

    def __post_init__(self) -> None:
        check("endpoint.port", self.port, 0 <= self.port < 65536, "in [0, 65535]")
        if self.host not in LOOPBACK and not self.api_key:
            raise ConfigError(f"endpoint.host={self.host!r} is invalid without endpoint.api_key: an address other "
                              f"than loopback {list(LOOPBACK)} serves the policy to the network, so it needs a "
                              "bearer token")
        check("endpoint.model", self.model, bool(self.model), "a non-empty name")
        check("endpoint.max_queued", self.max_queued, self.max_queued >= 1, ">= 1")
        check("endpoint.max_sessions", self.max_sessions, self.max_sessions >= 1, ">= 1")
        check("endpoint.max_n", self.max_n, self.max_n >= 1, ">= 1")
        check("endpoint.session_idle_s", self.session_idle_s, self.session_idle_s > 0, "> 0")
        check("endpoint.request_timeout_s", self.request_timeout_s, self.request_timeout_s > 0, "> 0")


@dataclass(frozen=True)
class AgentConfig:
    fn: str = ""
    """The agent, by import path: 'my_pkg.agent:run', called as run(base_url, api_key, sample) -> reward."""
    timeout_s: float = 300.0
    """Wall time one agent may take; past it its episode ends ('agent_timeout')."""
    workers: int = 32
    """Agents run at once per host (a thread each). One past `timeout_s` gives its place back; its thread, which
    cannot be killed, runs on until it returns (its session's later calls are refused)."""
    branches: str = "drop"
    """What the trainer gets of a session whose agent edited its history (each edit starts a branch): 'drop' trains
    the last branch only (the count of the others goes in its `env_info`); 'keep' trains every branch as its own
    trajectory in the group, each with the episode's reward, up to `branch_rows` more rows than the group's
    episodes."""
    branch_rows: int = 4
    """With branches 'keep': the rows each group holds beyond `inference.group_size` for earlier branches. The
    step's batch keeps its fixed shape (`train.train_batch_size` rows), so a group takes group_size + branch_rows
    of them and a step trains train_batch_size / (group_size + branch_rows) prompts; a group with fewer branches
    fills its rows with masked copies (no loss, no statistics), and one with more drops its earliest branches
    (counted in the last branch's `env_info` and `rollout/branches_dropped`)."""

    def __post_init__(self) -> None:
        check("agent.timeout_s", self.timeout_s, self.timeout_s > 0, "> 0")
        check("agent.workers", self.workers, self.workers >= 1, ">= 1")
        check_choice("agent.branches", self.branches, ("drop", "keep"))
        check("agent.branch_rows", self.branch_rows, self.branch_rows >= (1 if self.branches == "keep" else 0),
              ">= 1 with agent.branches=keep" if self.branches == "keep" else ">= 0")
