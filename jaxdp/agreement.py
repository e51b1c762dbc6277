"""Every process of a run must train with the same flags: checked at start-up, in seconds.

Processes started with different flags used to train quietly different models (--lr, --seed,
--batch-size), hang (--strategy) or time out (--devices, --checkpoint-dir). `check(config, ...)`
runs right after `jax.distributed.initialize`: every process publishes its effective config through
the key-value store of JAX's coordination service (`jaxdp/config/<process>`), reads everyone's, and
if any differ every process raises the same ConfigError (exit 2), naming the first differing flag
and each process's value.

Per-process fields (may differ; see PER_PROCESS): how the process found its place (--process-id,
--coordinator-address, --num-processes: a process may get them from flags and another from the
environment; JAX itself checks they fit together), the network interface its gloo collectives use
(--gloo-interface: interface names differ between machines), where process 0 writes logs (--metrics-file,
--log-dir: only process 0 writes them), and terminal output (--progress, --debug). Everything
else, --checkpoint-dir included (every process must write the same directory), must agree. The
device count is per process but must be equal, so it gets its own sentence.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from jaxdp.config import Config, ConfigError

_KEY = "jaxdp/config/"
PER_PROCESS = ("process_id", "coordinator_address", "num_processes", "gloo_interface", "metrics_file", "log_dir", "progress", "debug")


def agreed_fields(config: Config) -> dict[str, Any]:
    """The fields every process of a run must share, in flag order."""
    return {name: value for name, value in config.to_dict().items() if name not in PER_PROCESS}


def check(client: Any, config: Config, process: int, count: int, timeout_s: float,
          local_devices: Callable[[], int]) -> None:
    """ConfigError on every process if the processes' configs differ, or one cannot have its devices.

    `local_devices()` resolves --devices on this process (ConfigError if it has fewer); its message,
    or the count, is published with the config, so that a process that cannot run stops them all.
    """
    try:
        devices: int | str = local_devices()
    except ConfigError as err:
        devices = f"process {process}: {err}"
    mine = json.dumps({"config": agreed_fields(config), "devices": devices})
    client.key_value_set(f"{_KEY}{process}", mine)
    everyone = [mine if p == process else client.blocking_key_value_get(f"{_KEY}{p}", int(timeout_s * 1000))
                for p in range(count)]
    message = disagreement([json.loads(text) for text in everyone])
    if message:
        raise ConfigError(message)


def disagreement(published: list[dict]) -> str | None:
    """The sentence for the first difference between the processes' published records, or None."""
    configs = [p["config"] for p in published]
    for name in configs[0]:
        values = [c.get(name) for c in configs]
        if len(set(map(json.dumps, values))) == 1:
            continue
        flag = f"--{name.replace('_', '-')}"
        each = ", ".join(f"process {p} has {flag}={v!r}" for p, v in enumerate(values))
        if name == "devices":
            return (f"{flag} differs between processes ({each}); every process must use the same number of "
                    f"devices: pass the same {flag} to every process (or leave it out on identical machines)")
        return (f"{flag} differs between processes ({each}); start every process with the same flags "
                f"(only {', '.join('--' + f.replace('_', '-') for f in PER_PROCESS)} may differ)")
    devices = [p["devices"] for p in published]
    errors = [d for d in devices if isinstance(d, str)]
    if errors:
        return errors[0]
    if len(set(devices)) > 1:
        each = ", ".join(f"process {p} has {d}" for p, d in enumerate(devices))
        return (f"the processes have different numbers of devices ({each}); every process must use the same "
                f"number: pass --devices with the smallest count, {min(devices)}, to every process")
    return None
