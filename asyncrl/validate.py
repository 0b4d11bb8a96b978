"""Validation helpers shared by every config dataclass: errors name the dotted key and what is allowed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A bad config value; the message starts with the dotted key."""


def check(key: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: must be {allowed}")


def check_choice(key: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is invalid: must be one of {list(choices)}")
