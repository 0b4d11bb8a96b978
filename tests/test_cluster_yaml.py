"""Every `ray up` config in cluster/ passes the checks `ray up` itself runs before it touches GCP."""

from __future__ import annotations

import copy
import pathlib
import re
from typing import Any

import pytest
import yaml
from ray._private.accelerators import tpu
from ray._private.accelerators.tpu import TPUAcceleratorManager
from ray.autoscaler._private.util import prepare_config, validate_config

from asyncrl.aot.roofline import CHIPS

REPO = pathlib.Path(__file__).resolve().parents[1]
CLUSTER_YAMLS = sorted((REPO / "cluster").glob("*.yaml"))


def _fill_tpu_resources(config: dict[str, Any]) -> dict[str, Any]:
    """What GCPNodeProvider.fillout_available_node_types_resources adds; that class needs google-api-python-client."""
    try:
        from ray.autoscaler._private.gcp.node_provider import GCPNodeProvider
    except ImportError:
        config = copy.deepcopy(config)
        for node_type in config.get("available_node_types", {}).values():
            accelerator = node_type["node_config"].get("acceleratorType")
            if accelerator and "machineType" not in node_type["node_config"]:
                node_type["resources"][f"TPU-{accelerator}-head"] = 1
        return config
    return GCPNodeProvider.fillout_available_node_types_resources(config)


def _check_tpu_node_configs(config: dict[str, Any]) -> None:
    """The TPU check bootstrap_gcp runs first (gcp.config.get_node_type), without its GCP client imports."""
    for name, node_type in config["available_node_types"].items():
        accelerator = node_type["node_config"].get("acceleratorType")
        if accelerator is not None and not TPUAcceleratorManager.is_valid_tpu_accelerator_type(accelerator):
            raise ValueError(f"{name}: acceleratorType should match v(generation)-(cores/chips); got {accelerator!r}")


def validate_cluster_yaml(path: pathlib.Path) -> dict[str, Any]:
    """The offline part of `ray up`: fill defaults, add TPU head resources, validate the schema, check TPU types."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    config = prepare_config(copy.deepcopy(raw))
    try:
        config = _fill_tpu_resources(config)
    except KeyError:
        pass  # `ray up` only warns when this fails; validate_config names the missing key
    validate_config(config)
    _check_tpu_node_configs(config)
    return config


def _tpu_node_types(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: nt for name, nt in config["available_node_types"].items() if "acceleratorType" in nt["node_config"]
    }


def test_there_are_cluster_configs() -> None:
    names = {p.name for p in CLUSTER_YAMLS}
    assert {"tpu-v5p-64.yaml", "tpu-v6e-8.yaml"} <= names


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_validates_with_rays_own_checks(path: pathlib.Path) -> None:
    config = validate_cluster_yaml(path)
    assert config["head_node_type"] in config["available_node_types"]
    # The head is a CPU VM: the job API and the job's driver live there.
    assert "acceleratorType" not in config["available_node_types"][config["head_node_type"]]["node_config"]


@pytest.mark.parametrize("path", [p for p in CLUSTER_YAMLS if p.name.startswith("tpu-")], ids=lambda p: p.name)
def test_tpu_layout_matches_ray_and_roofline(path: pathlib.Path) -> None:
    config = validate_cluster_yaml(path)
    ((_, node_type),) = _tpu_node_types(config).items()
    accelerator = node_type["node_config"]["acceleratorType"]
    assert node_type["node_config"]["runtimeVersion"]
    assert node_type["min_workers"] == node_type["max_workers"] == 1  # one whole slice, never autoscaled
    per_host = tpu.get_num_tpu_visible_chips_per_host(accelerator)
    total = tpu.get_total_chips_from_accelerator_type(accelerator)
    # The declared per-host TPU count is what Ray exports to each host's `ray start`; it must be the real one.
    assert node_type["resources"]["TPU"] == per_host
    assert node_type["resources"][f"TPU-{accelerator}-head"] == 1
    generation = accelerator.split("-")[0]
    assert CHIPS[generation].chips_per_host_for(total) == per_host


def test_v5p_64_is_eight_hosts_of_four_chips() -> None:
    assert tpu.get_total_chips_from_accelerator_type("v5p-64") == 32
    assert tpu.get_num_tpu_visible_chips_per_host("v5p-64") == 4
    assert tpu.get_num_tpu_visible_chips_per_host("v6e-8") == 8


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_installs_this_project_with_token_auth(path: pathlib.Path) -> None:
    config = validate_cluster_yaml(path)
    mounts = config["file_mounts"]
    project_remote = next(remote for remote, local in mounts.items() if local == ".")
    assert (REPO / "requirements.txt").is_file()  # "." is the repo root when `ray up` runs from it
    setup = config["setup_commands"] + config["worker_setup_commands"]
    assert any(f"-r {project_remote}/requirements.txt" in cmd for cmd in setup)
    assert "~/.ray/auth_token" in mounts
    for cmd in config["head_start_ray_commands"] + config["worker_start_ray_commands"]:
        if " start " in cmd:
            assert "RAY_AUTH_MODE=token" in cmd


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_dashboard_listens_on_loopback_only(path: pathlib.Path) -> None:
    """The head's dashboard and job API are reached through an SSH tunnel, never on a public interface."""
    config = validate_cluster_yaml(path)
    starts = [cmd for cmd in config["head_start_ray_commands"] if " start " in cmd]
    assert starts and all("--dashboard-host=127.0.0.1" in cmd for cmd in starts), starts
    assert "0.0.0.0" not in path.read_text()
    assert "ray dashboard" in path.read_text() and "ssh -L" in path.read_text()  # the comment says how to tunnel


def test_tpu_configs_share_setup() -> None:
    """The configs differ only in the TPU: install and start commands must not drift apart."""
    keys = ("setup_commands", "head_setup_commands", "worker_setup_commands", "head_start_ray_commands",
            "worker_start_ray_commands", "file_mounts", "rsync_exclude", "rsync_filter")
    loaded = [yaml.safe_load(p.read_text()) for p in CLUSTER_YAMLS if p.name.startswith("tpu-")]
    for other in loaded[1:]:
        for key in keys:
            assert other[key] == loaded[0][key], key


def _broken(tmp_path: pathlib.Path, mutate: Any) -> pathlib.Path:
    config = yaml.safe_load((REPO / "cluster" / "tpu-v5p-64.yaml").read_text())
    mutate(config)
    out = tmp_path / "broken.yaml"
    out.write_text(yaml.safe_dump(config))
    return out


def _drop_tpu_resources(c: dict[str, Any]) -> None:
    del c["available_node_types"]["tpu_v5p_64"]["resources"]


def _unknown_key(c: dict[str, Any]) -> None:
    c["available_node_types"]["tpu_v5p_64"]["acclerator"] = "v5p-64"


def _bad_head(c: dict[str, Any]) -> None:
    c["head_node_type"] = "no_such_type"


def _bad_accelerator(c: dict[str, Any]) -> None:
    c["available_node_types"]["tpu_v5p_64"]["node_config"]["acceleratorType"] = "v5p"


def _negative_tpu(c: dict[str, Any]) -> None:
    c["available_node_types"]["tpu_v5p_64"]["resources"]["TPU"] = -4


@pytest.mark.parametrize(
    "mutate,message",
    [
        (_drop_tpu_resources, "'resources' is a required property"),
        (_unknown_key, "'acclerator' was unexpected"),
        (_bad_head, "head_node_type"),
        (_bad_accelerator, "acceleratorType"),
        (_negative_tpu, "minimum"),
    ],
)
def test_broken_copy_fails(tmp_path: pathlib.Path, mutate: Any, message: str) -> None:
    import jsonschema

    assert validate_cluster_yaml(_broken(tmp_path, lambda c: None))  # the unmodified copy is fine
    with pytest.raises((jsonschema.ValidationError, ValueError), match=re.escape(message)):
        validate_cluster_yaml(_broken(tmp_path, mutate))
