"""Eight simulated CPU devices for every test, set once before JAX starts its backend."""

import os
import subprocess
import sys
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def devices():
    assert len(jax.devices()) == 8, "conftest must set 8 simulated devices before JAX starts"
    return jax.devices()


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for a CLI subprocess: no inherited device-count flag, so the CLI decides."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(extra)
    return env


def run_cli(*args: str, module: str = "jaxdp.train", timeout: float = 240, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=kwargs.pop("cwd", ROOT), env=kwargs.pop("env", cli_env()), **kwargs)
