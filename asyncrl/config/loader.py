"""Compose YAML files from `configs/` into the typed `Config`, Hydra style, with validation up front.

    configs/<name>.yaml     may start with `defaults: [{model: tiny}, {loss: cispo}, {task: digits}]`
    configs/<group>/<x>.yaml holds only the fields of section <group>
    overrides               `group=option` swaps a preset; `a.b=value` sets a field (value parsed as YAML)

Every error (unknown key, wrong type, out-of-range value, malformed override) is a `ConfigError` whose message
starts with the dotted key, raised before any JAX work starts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from asyncrl.config.schema import Config
from asyncrl.validate import ConfigError

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
_ALIASES = {"async": "async_"}  # YAML/CLI name -> dataclass field name


def _alias_key(key: str) -> str:
    head, _, rest = key.partition(".")
    head = _ALIASES.get(head, head)
    return f"{head}.{rest}" if rest else head


def _unalias(msg: str) -> str:
    return msg.replace("async_", "async")


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at top level")
    return data


def groups(config_dir: str = CONFIG_DIR) -> dict[str, list[str]]:
    """Config groups (sub-folders) and their options."""
    out = {}
    for g in sorted(os.listdir(config_dir)):
        d = os.path.join(config_dir, g)
        if os.path.isdir(d):
            out[g] = sorted(f[:-5] for f in os.listdir(d) if f.endswith(".yaml"))
    return out


def parse_overrides(overrides: Sequence[str], config_dir: str = CONFIG_DIR
                    ) -> tuple[dict[str, str], list[tuple[str, Any]]]:
    """Split CLI overrides into group choices and dotted field assignments."""
    known_groups = groups(config_dir)
    choices: dict[str, str] = {}
    fields: list[tuple[str, Any]] = []
    for item in overrides:
        key, eq, raw = item.partition("=")
        key = key.strip().lstrip("+")
        if not eq or not key or any(c.isspace() for c in key):
            raise ConfigError(f"override {item!r} is malformed: expected key=value, e.g. inference.temperature=0.7")
        if "." not in key and key in known_groups:
            if raw not in known_groups[key]:
                raise ConfigError(f"{key}={raw!r} is invalid: must be one of {known_groups[key]}")
            choices[key] = raw
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from e
        fields.append((key, value))
    return choices, fields


def split_config_name(argv: Sequence[str]) -> tuple[str, list[str]]:
    """`[--config-name NAME | --config-name=NAME] overrides...` -> (NAME or "default", overrides): the one parser of
    `--config-name`, shared by every command that takes a run config (run, submit, aot, plan)."""
    name, rest, i = "default", [], 0
    argv = list(argv)
    while i < len(argv):
        a = argv[i]
        if a == "--config-name":
            if i + 1 >= len(argv):
                raise ConfigError("--config-name needs a value: the name of a file in configs/, e.g. "
                                  "--config-name default")
            name = argv[i + 1]
            i += 2
            continue
        if a.startswith("--config-name="):
            name = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return name, rest


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def _alias_tree(d: dict[str, Any]) -> dict[str, Any]:
    return {_ALIASES.get(k, k): v for k, v in d.items()}


def load_config(name: str = "default", overrides: Sequence[str] = (), config_dir: str = CONFIG_DIR) -> Config:
    """Compose `configs/<name>.yaml`, its group defaults and the overrides into a validated Config."""
    main_path = os.path.join(config_dir, f"{name}.yaml")
    if not os.path.isfile(main_path):
        options = sorted(f[:-5] for f in os.listdir(config_dir) if f.endswith(".yaml"))
        raise ConfigError(f"--config-name {name!r}: no {main_path}; available: {options}")
    main = _read_yaml(main_path)
    defaults = main.pop("defaults", []) or []
    choices: dict[str, str] = {}
    for entry in defaults:
        if not isinstance(entry, dict) or len(entry) != 1:
            raise ConfigError(f"{main_path}: each defaults entry must be a single {{group: option}} mapping, "
                              f"got {entry!r}")
        choices.update({str(k): str(v) for k, v in entry.items()})
    cli_choices, fields = parse_overrides(overrides, config_dir)
    choices.update(cli_choices)

    layers: list[dict[str, Any]] = []
    for group, option in choices.items():
        path = os.path.join(config_dir, group, f"{option}.yaml")
        if not os.path.isfile(path):
            raise ConfigError(f"{group}={option!r} is invalid: no {path}; options: {groups(config_dir).get(group, [])}")
        layers.append(_alias_tree({group: _read_yaml(path)}))
    layers.append(_alias_tree(main))
    for key, value in fields:
        layers.append(_nest(_alias_key(key), value))

    try:
        merged = OmegaConf.structured(Config)
        for layer in layers:
            merged = OmegaConf.merge(merged, OmegaConf.create(layer))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = _unalias(str(getattr(e, "full_key", "") or ""))
        msg = _unalias(getattr(e, "msg", str(e)).split("\n")[0])
        if "'TaskSourceConfig'" in msg and key.split(".")[-1] == "name":  # OmegaConf loses a list item's path
            key = next((f"task.sources[{i}].name" for layer in layers
                        for i, src in enumerate((layer.get("task") or {}).get("sources") or [])
                        if isinstance(src, dict) and "name" in src), key)
            msg += "; a source names its environment (a built-in name or pkg.module:ATTR) with `environment:`"
        raise ConfigError(f"{key}: {msg}" if key else msg) from None
    except ValueError as e:  # __post_init__ checks; already name their key
        raise ConfigError(_unalias(str(e))) from None
    assert isinstance(cfg, Config)
    return cfg


def load_run_config(path: str) -> Config:
    """A run's resolved `config.yaml` (what the driver writes into the run directory) back into a Config."""
    data = _migrate_sources(_alias_tree(_read_yaml(path)))
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(data))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = _unalias(str(getattr(e, "full_key", "") or ""))
        raise ConfigError(f"{path}: {key}: {_unalias(getattr(e, 'msg', str(e)).splitlines()[0])}") from None
    except ValueError as e:
        raise ConfigError(f"{path}: {_unalias(str(e))}") from None
    assert isinstance(cfg, Config)
    return cfg


def _migrate_sources(data: dict[str, Any]) -> dict[str, Any]:
    """Run folders written before environments were named by import path kept the task (`name`) and the episode
    (`environment`: single_turn, tools, ...) apart; one key names both now, and `tools: true` marks a tool source.
    Read so that `plan --from-run` and `evaluate` still take an older run."""
    for src in (data.get("task") or {}).get("sources") or []:
        if isinstance(src, dict) and "name" in src:
            old_episode = src.get("environment")
            src["environment"] = src.pop("name")
            if old_episode == "tools":
                src["tools"] = True
    return data


def to_yaml(cfg: Config) -> str:
    data = OmegaConf.to_container(OmegaConf.structured(cfg))
    assert isinstance(data, dict)
    return yaml.safe_dump({"async" if k == "async_" else k: v for k, v in data.items()}, sort_keys=False)
