"""What every benchmark records beside its figures: the CPU model, its vector extensions, the XLA flags and thread
settings in force, and the load when it started. Figures differ by machine (issue #26: our decode was 2.27x
transformers on one 2-core machine and 1.1x on another), so a figure without these is not a result."""

from __future__ import annotations

import os
import platform

from asyncrl.aot.libtpu import quiet_libtpu_without_tpu

# Every benchmark that imports this module does so before its first JAX computation, which is when libtpu (in a
# venv with requirements-tpu.txt) loads: on a machine with no TPU that keeps its start-up error lines off the
# console; on a TPU host it does nothing.
quiet_libtpu_without_tpu()

VECTOR_PREFIXES = ("avx", "fma", "amx", "sse4", "f16c", "vnni", "bf16")


def _cpuinfo() -> tuple[str, list[str]]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return platform.processor() or platform.machine(), []
    lines = text.splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.machine())
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith(("flags", "Features"))), [])
    return name, flags


def machine() -> dict:
    name, flags = _cpuinfo()
    vector = sorted(f for f in flags if f.startswith(VECTOR_PREFIXES))
    env = {k: os.environ[k] for k in ("XLA_FLAGS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL")
           if k in os.environ}
    out = {"cpu": name, "cores": os.cpu_count(), "vector": " ".join(vector),
           "avx512": any(f.startswith("avx512") for f in flags), "load_1m_at_start": os.getloadavg()[0],
           "python": platform.python_version(), "env": env}
    try:
        import jax

        out["jax"] = jax.__version__
        out["backend"] = jax.default_backend()
    except ImportError:
        pass
    return out


def describe(m: dict) -> str:
    """One line for a table's header."""
    ext = "AVX-512" if m.get("avx512") else ("AVX2" if "avx2" in m.get("vector", "") else "no AVX2")
    flags = m.get("env", {}).get("XLA_FLAGS", "")
    return (f"{m['cpu']} ({m['cores']} cores, {ext}), load {m['load_1m_at_start']:.2f} at start"
            + (f", XLA_FLAGS={flags}" if flags else ""))
