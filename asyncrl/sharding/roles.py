"""Which devices train and which infer: the one place that splits a job's devices by host into roles.

As in the blog, the first `train_workers` hosts (JAX processes, in process-index order) are trainers and the
rest run inference. The run splits `jax.devices()`; `launch.py aot` splits a TPU topology's devices the same way,
so what it compiles is what the run would execute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RoleSplit:
    hosts: list[list[Any]]
    """Every host's devices, in process-index order; each host's devices in id order."""
    train_workers: int

    @property
    def trainer_devices(self) -> list[Any]:
        return [d for h in self.hosts[: self.train_workers] for d in h]

    @property
    def inference_hosts(self) -> list[list[Any]]:
        return self.hosts[self.train_workers :]

    def host_devices(self, process_index: int) -> list[Any]:
        return self.hosts[process_index]

    def slots(self) -> list[list[Any]]:
        """The weight-sync hop chain's slots: runs of `train_workers` consecutive hosts (slot 0 = the trainers)."""
        tw = self.train_workers
        return [[d for h in self.hosts[j : j + tw] for d in h] for j in range(0, len(self.hosts), tw)]


def split_roles(devices: Sequence[Any], train_workers: int, hosts: int | None = None) -> RoleSplit:
    """Group `devices` by `process_index` and give the first `train_workers` hosts the trainer role.

    `hosts` regroups the devices into that many equal *simulated* hosts instead, in (process, id) order: what a
    local run does with fake CPU devices, and what `launch.py aot` does for a slice that libtpu lays out as fewer
    hosts than the config asks for (a 4-chip v5p:2x2x1 is one host; the tiny preset runs it as 2 x 2).

    Raises (naming the field) when the split cannot be made: every host must have the same number of devices,
    there must be at least one inference host, and `train_workers` must divide the hosts (the hop chain moves
    between equal slots)."""
    by_host: dict[int, list[Any]] = {}
    for d in devices:
        by_host.setdefault(d.process_index, []).append(d)
    groups = [sorted(by_host[p], key=lambda d: d.id) for p in sorted(by_host)]
    if hosts is not None and hosts != len(groups):
        flat = [d for g in groups for d in g]
        if hosts < 1 or len(flat) % hosts:
            raise ValueError(f"run.hosts={hosts} does not divide the {len(flat)} devices into equal hosts")
        k = len(flat) // hosts
        groups = [flat[i * k : (i + 1) * k] for i in range(hosts)]
    return _checked(groups, train_workers)


def _checked(hosts: list[list[Any]], train_workers: int) -> RoleSplit:
    n = len(hosts)
    if not 1 <= train_workers < n or n % train_workers != 0:
        raise ValueError(f"async.train_workers={train_workers} must be in [1, {n}) and divide the {n} hosts "
                         "(every weight-sync hop moves between equal-sized slots)")
    sizes = {len(h) for h in hosts}
    if len(sizes) != 1:
        raise ValueError(f"hosts have different device counts {sorted(sizes)}; every host must drive as many chips")
    return RoleSplit(hosts, train_workers)
