"""Test-wide setup. Fake CPU devices must be configured before JAX touches a backend, so it happens here."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: heavy test (real model, multi-process); deselect with -m 'not slow'")
