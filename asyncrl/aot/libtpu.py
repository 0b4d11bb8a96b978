"""Quiet libtpu on a machine with no TPU, where it is only a compiler for `launch.py aot` / `plan`.

Any JAX process in a venv with libtpu installed loads it when the first backend starts (plugin discovery), and
on a host without TPU chips libtpu 0.0.42.1 cannot find out what it runs on. It then prints five lines to the
console from native code ("Failed to find host bounds for accelerator type", "E0000 ... INVALID_ARGUMENT: Error:
unexpected worker hostname", a source-location trace) before the first line of ours; the compile succeeds
anyway. Measured here: setting TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES before the backend starts removes
every one of them (each variable alone removes only its half), and the devices of every topology we target
(v5p, v6e, v5e, v4) stay the same, as do the rows of `launch.py aot --config-name tpu_tiny` on v5p:2x2x1 and
v6e:2x4 (compared with and without, 2026-12-06).

libtpu also writes INFO logs of every compile to /tmp/tpu_logs, and a local Ray cluster (`python launch.py`)
streams whatever appears there to its driver's console ("(pid=) I1206 ... deepsea_compiler_backend.cc ..."), so
a `launch.py aot` beside a local run filled the run's console with the compiler's logs. Without a TPU they go
under the asyncrl cache instead (TPU_LOG_DIR; ASYNCRL_CACHE, default ~/.cache/asyncrl, as for converted models).

A host with TPU chips attached, or one where the user set any of libtpu's topology variables, is left exactly as
it is: there libtpu's messages matter and the values are real.
"""

from __future__ import annotations

import glob
import os
import pathlib

# What the values tell libtpu: a one-host slice reached at localhost. On a host with no chips nothing is laid out
# from them; the topology we compile for comes from `get_topology_desc(topology_name=...)` alone.
_QUIET_ENV = {"TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_WORKER_HOSTNAMES": "localhost"}
# Variables through which a user (or a TPU VM's image) describes a real slice: any one of them set means hands off.
# Not TPU_SKIP_MDS_QUERY: `import jax` itself sets it to 1 on a host with no chips.
_USER_TPU_ENV = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_HOST_BOUNDS",
                 "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_PROCESS_BOUNDS", "TPU_TOPOLOGY", "TPU_NAME", "CLOUD_TPU_TASK_ID",
                 "JAX_FORCE_TPU_INIT")
_GOOGLE_PCI_VENDOR = "0x1ae0"
# Google's TPU PCI device ids (v3, v4, v5p, v5e, v6e, TPU7x), as jax/_src/hardware_utils.py lists them; the same
# vendor id also covers gVNIC network cards, so the vendor alone does not mean a TPU.
_TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}


def tpu_attached() -> bool:
    """True if this host has TPU chips: accel or VFIO device nodes (how TPU VMs expose them), or a TPU on PCI."""
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if pathlib.Path(vendor).read_text().strip() != _GOOGLE_PCI_VENDOR:
                continue
            device = pathlib.Path(os.path.dirname(vendor), "device").read_text().strip()
        except OSError:
            continue
        if device in _TPU_PCI_DEVICES:
            return True
    return False


def quiet_libtpu_without_tpu() -> bool:
    """Set the variables that keep libtpu silent, if this host has no TPU and the user set none of libtpu's own.
    Call it before the first JAX backend starts (`jax.devices()`, the first computation or compile); `import jax`
    alone does not load libtpu. Returns whether it set them. Never overrides a variable already set."""
    if any(k in os.environ for k in _USER_TPU_ENV) or tpu_attached():
        return False
    for key, value in _QUIET_ENV.items():
        os.environ.setdefault(key, value)
    cache = os.environ.get("ASYNCRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "asyncrl"))
    os.environ.setdefault("TPU_LOG_DIR", os.path.join(cache, "tpu_logs"))  # libtpu creates it
    return True
