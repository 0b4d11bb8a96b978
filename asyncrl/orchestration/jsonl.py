"""The run directory's JSON-lines logs (metrics, rollouts, evals, eval samples, the hosts history), kept whole
across failures. A host can be SIGKILLed at any instruction and the next attempt appends to the same files, so:

- `append` writes a batch of records (a step's rollouts, an eval round) in one `write` on an O_APPEND file: a
  batch lands whole or not at all, and one process's batch never interleaves with another's;
- `read` skips a line that does not parse (a write cut short by a full disk or a killed driver), and says so;
- `truncate` rewrites a file to the records a predicate keeps, atomically (a temporary file, then a rename): the
  driver cuts every log back to the checkpoint it resumes from, so no step, round or group appears twice and no
  torn tail is appended to;
- `write_json` replaces a whole JSON file atomically (`hosts.json`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)


def append(path: str, records: Iterable[dict[str, Any]]) -> None:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    if not data:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:  # a regular file takes it in one write; a short write would only come from a full disk
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def read(path: str) -> list[dict[str, Any]]:
    """Every record of `path` ([] when it does not exist), skipping lines that do not parse."""
    if not os.path.exists(path):
        return []
    out, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
    if bad:
        log.warning("%s: skipped %d torn line(s) (a write cut short by a failure)", path, bad)
    return out


def truncate(path: str, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Rewrite `path` with the records `keep` accepts (torn lines dropped); returns how many were dropped."""
    if not os.path.exists(path):
        return 0
    records = read(path)
    kept = [r for r in records if keep(r)]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)
    return len(records) - len(kept)


def write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
