"""The server's request rate and latency, on the Ray dashboard when the server runs inside a Ray worker (the
inference hosts of a run), and as plain counters always (tests, a standalone server)."""

from __future__ import annotations

import sys
from typing import Any

_BOUNDARIES = [0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0]


class ServerMetrics:
    def __init__(self, name: str):
        self.requests = 0
        self.latency_s = 0.0
        self._ray: tuple[Any, Any] | None = None
        ray = sys.modules.get("ray")  # only a process that runs Ray has imported it: never import it here
        if ray is not None and ray.is_initialized():
            from ray.util import metrics

            tags = {"server": name}
            self._ray = (metrics.Counter("endpoint_requests", "OpenAI endpoint requests answered", ("server",
                                                                                                      "status")),
                         metrics.Histogram("endpoint_latency_s", "OpenAI endpoint request latency (s)", _BOUNDARIES,
                                           ("server",)))
            self._ray[0].set_default_tags(tags)
            self._ray[1].set_default_tags(tags)

    def observe(self, status: int, seconds: float) -> None:
        self.requests += 1
        self.latency_s += seconds
        if self._ray is not None:
            self._ray[0].inc(1, {"status": str(status)})
            self._ray[1].observe(seconds)
