"""Process and device set-up: everything that must happen before JAX starts its backend.

`initialize(config)` is the only caller of `jax.distributed.initialize` in jaxdp. It takes one of
three branches and logs which: explicit flags, the cluster environment (SLURM), or a single
process. `local_devices(config)` then picks the devices this process trains on.
"""

from __future__ import annotations

import logging
import os

import jax

from jaxdp.config import Config, ConfigError

log = logging.getLogger("jaxdp")

DEFAULT_CPU_DEVICES = 8  # simulate data parallelism on a laptop


def initialize(config: Config) -> str:
    """Start jax.distributed if this is a multi-process run; returns the branch taken."""
    _simulate_cpu_devices(config.devices or DEFAULT_CPU_DEVICES)
    if config.coordinator_address or config.num_processes or config.process_id is not None:
        missing = [flag for flag, value in (("--coordinator-address", config.coordinator_address),
                                            ("--num-processes", config.num_processes),
                                            ("--process-id", config.process_id)) if value is None]
        if missing:
            raise ConfigError(f"a multi-process run needs {', '.join(missing)} as well")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=config.coordinator_address,
                                   num_processes=config.num_processes, process_id=config.process_id)
        branch = "explicit"
    else:
        branch = "single"
    log.info("jaxdp.distributed: %s (process %d of %d)", branch, jax.process_index(), jax.process_count())
    return branch


def _simulate_cpu_devices(n: int) -> None:
    """Ask the CPU backend for `n` devices, unless it already started or XLA_FLAGS decides."""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backend already running (a notebook, a test): local_devices() picks from what exists


def local_devices(config: Config) -> list[jax.Device]:
    """The devices this process trains on: the first --devices of its local devices (default all)."""
    available = jax.local_devices()
    wanted = config.devices or len(available)
    if wanted > len(available):
        raise ConfigError(f"--devices={wanted} but this process has only {len(available)} "
                          f"{available[0].platform} devices; ask for at most {len(available)}")
    return available[:wanted]


def global_devices(config: Config) -> list[jax.Device]:
    """Every process's chosen devices: the first --devices local devices of each process."""
    n = len(local_devices(config))
    by_process: dict[int, list[jax.Device]] = {}
    for device in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        by_process.setdefault(device.process_index, []).append(device)
    return [d for devices in by_process.values() for d in devices[:n]]
