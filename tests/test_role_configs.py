"""The run config split by role (`asyncrl/orchestration/role_config.py`, `asyncrl/aot/programs.ProgramsConfig`):
built from configs/default.yaml and every preset, each role gets its sections typed and unchanged, and no function
in asyncrl/ takes a run config (or a section of one) as `Any` or untyped."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import pickle
import re
import types
import typing

import pytest

from asyncrl.aot.programs import ProgramsConfig
from asyncrl.cli.aot import programs_config
from asyncrl.config.loader import CONFIG_DIR, load_config
from asyncrl.config.schema import Config
from asyncrl.orchestration.role_config import DriverConfig, HostConfig, InferenceRoleConfig, TrainerRoleConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
PRESETS = sorted(p.stem for p in pathlib.Path(CONFIG_DIR).glob("*.yaml"))


def _check_types(obj: object, where: str) -> None:
    """Every field of the dataclass `obj` holds a value of its annotated type (nested role configs included)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, want = getattr(obj, f.name), hints[f.name]
        allowed = typing.get_args(want) if isinstance(want, types.UnionType) else (want,)
        allowed = tuple(type(None) if a is None else typing.get_origin(a) or a for a in allowed)
        assert any(a is not typing.Any for a in allowed), f"{where}.{f.name} is typed Any"
        assert isinstance(value, allowed), f"{where}.{f.name}: {type(value).__name__}, declared {want}"
        if dataclasses.is_dataclass(value) and type(value).__module__.startswith("asyncrl.orchestration.role_config"):
            _check_types(value, f"{where}.{f.name}")


def test_every_preset_is_found():
    assert "default" in PRESETS and len(PRESETS) > 5, PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_each_role_gets_its_sections_typed_and_unchanged(name):
    cfg = load_config(name)
    trainer, inference, host = cfg.trainer_role(), cfg.inference_role(), cfg.host_config()
    driver, programs = cfg.driver_config(), programs_config(cfg)
    for role, cls in ((trainer, TrainerRoleConfig), (inference, InferenceRoleConfig), (host, HostConfig),
                      (driver, DriverConfig), (programs, ProgramsConfig)):
        assert type(role) is cls
        _check_types(role, f"{name}:{cls.__name__}")
        assert pickle.loads(pickle.dumps(role)) == role  # what Ray does to a host actor's arguments

    # The sections are the config's own objects: the same values reach the same places.
    for section in ("model", "train", "loss", "sharding", "async_", "checkpoint", "eval", "logging", "task", "tools",
                    "weightsync"):
        assert getattr(trainer, section) is getattr(cfg, section), section
    assert (trainer.seed, trainer.run_name, trainer.prompts_per_step, trainer.group_size, trainer.temperature,
            trainer.params_dtype) == (cfg.run.seed, cfg.run.name, cfg.prompts_per_step, cfg.inference.group_size,
                                      cfg.inference.temperature, cfg.inference.params_dtype)
    for section in ("model", "inference", "task", "tools", "async_", "weightsync"):
        assert getattr(inference, section) is getattr(cfg, section), section
    assert inference.lora is cfg.train.lora
    assert (inference.seed, inference.eval_prompts) == (cfg.run.seed, cfg.eval.num_prompts)
    assert (host.train_workers, host.log_level, host.platform) == (cfg.async_.train_workers, cfg.logging.level,
                                                                   cfg.run.platform)
    assert host.trainer == trainer and host.inference == inference
    assert driver.run is cfg.run and driver.async_ is cfg.async_ and driver.logging is cfg.logging
    assert driver.host == host and driver.resume == cfg.checkpoint.resume
    assert (driver.total_steps, driver.prompts_per_step, driver.eval_prompts) == (
        cfg.train.total_steps, cfg.prompts_per_step, cfg.eval.num_prompts)
    for section in ("model", "inference", "train", "loss", "sharding"):
        assert getattr(programs, section) is getattr(cfg, section), section
    assert (programs.train_workers, programs.hosts) == (cfg.async_.train_workers, cfg.run.hosts)


def test_the_split_drops_no_section():
    """Every section of the run config reaches some role (the driver's tree or the AOT programs)."""
    cfg = load_config("default")
    reached: set[int] = set()

    def walk(obj: object) -> None:
        reached.add(id(obj))
        if dataclasses.is_dataclass(obj) and type(obj).__module__.startswith(("asyncrl.orchestration.role_config",
                                                                               "asyncrl.aot.programs")):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))

    walk(cfg.driver_config())
    walk(programs_config(cfg))
    missing = [f.name for f in dataclasses.fields(Config) if id(getattr(cfg, f.name)) not in reached]
    assert not missing, f"sections no role receives: {missing}"


def test_a_restart_resumes_in_the_trainers_config():
    cfg = load_config("default", ["checkpoint.resume=false"])
    driver = cfg.driver_config()
    assert not driver.resume
    again = driver.with_resume()
    assert again.resume and again.host.trainer.checkpoint.resume
    assert again.host.trainer.checkpoint == dataclasses.replace(cfg.checkpoint, resume=True)
    assert again.host.inference == driver.host.inference and again.run is driver.run


# A run config's parameters: `cfg`, `*_cfg`, and the model section (`section` in models/sources.py).
_CONFIG_PARAM = re.compile(r"^(cfg|\w+_cfg|section)$")


def _is_any(ann: str | None) -> bool:
    """Untyped, or typed `Any` (alone or in a union: `Any | None`); `dict[str, Any]` is a typed dict."""
    return ann is None or any(part.strip() in ("Any", "typing.Any") for part in ann.split("|"))


def _scan(source: str, rel: str) -> list[str]:
    """The run-config parameters (and dataclass fields) of one module that are untyped or typed `Any`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                ann = ast.unparse(arg.annotation) if arg.annotation is not None else None
                if _CONFIG_PARAM.match(arg.arg) and _is_any(ann):
                    out.append(f"{rel}:{arg.lineno} {getattr(node, 'name', 'lambda')}({arg.arg}: {ann})")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and _CONFIG_PARAM.match(node.target.id) and _is_any(ast.unparse(node.annotation)):
            out.append(f"{rel}:{node.lineno} field {node.target.id}: {ast.unparse(node.annotation)}")
    return out


def test_no_function_takes_a_run_config_untyped():
    found = [x for path in sorted((ROOT / "asyncrl").rglob("*.py"))
             for x in _scan(path.read_text(), path.relative_to(ROOT).as_posix())]
    assert not found, "run configs passed untyped:\n" + "\n".join(found)
    grep = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "asyncrl").rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bcfg: Any\b", line)]
    assert not grep, grep


@pytest.mark.parametrize("source,flagged", [
    ("def f(cfg: Any): ...", True),
    ("def f(cfg): ...", True),
    ("def f(x, *, model_cfg: Any | None = None): ...", True),
    ("g = lambda cfg: cfg", True),
    ("class T:\n    cfg: Any", True),
    ("def f(section: typing.Any): ...", True),
    ("def f(cfg: Config): ...", False),
    ("def f(lora_cfg: LoraConfig | None): ...", False),
    ("def f(config, anything: Any): ...", False),
    ("def f(cfg: dict[str, Any]): ...", False),
])
def test_the_scan_sees_what_it_forbids(source, flagged):
    """The checker itself, on sources that break the rule and sources that keep it."""
    assert bool(_scan(source, "synthetic.py")) == flagged, source
