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
--log-dir, --wandb-project: only process 0 writes them), the --tokenizer file's path (an absolute path
that may differ between machines; what it produced is compared: the token ids' fingerprint, below),
and terminal output (--progress, --debug). Everything
else, --checkpoint-dir included (every process must write the same directory), must agree. The
device count is per process but must be equal, so it gets its own sentence.

The same flags can still name different data: a relative --dataset path read from another working
directory, a node whose copy is missing, shorter or holds a bad token id. `load_dataset` has every
process load and check its own, publish the outcome (its error, or a fingerprint of what it read:
sizes and a digest of sampled blocks) under `jaxdp/inputs/<process>`, and read everyone's. If any
process's input is bad, or their data differ, every process raises the same InputError (exit 2)
naming the process and the input, before the first collective: one process stopping alone used to
leave the others waiting inside a collective until JAX aborted them (SIGABRT, C++ traces).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, Callable

from jaxdp.config import Config, ConfigError
from jaxdp.errors import InputError

_KEY = "jaxdp/config/"
_INPUTS_KEY = "jaxdp/inputs/"
INPUTS_WAIT_S = 3600.0  # a process slow to load (a large file on a slow disk) is waited for this long; a
                        # process that dies or stops meanwhile is reported by the peer watch and the heartbeat
PER_PROCESS = ("process_id", "coordinator_address", "num_processes", "gloo_interface", "metrics_file", "log_dir",
               "wandb_project", "tokenizer", "progress", "debug", "model_path")


def agreed_fields(config: Config) -> dict[str, Any]:
    """The fields every process of a run must share, in flag order."""
    return {name: value for name, value in config.to_dict().items() if name not in PER_PROCESS}


PRINT_HEX = 4  # hex digits of each field's print (`prints`): a difference slips through one time in 65,536


def prints(config: Config) -> str:
    """The fields every process must share (`agreed_fields`), as one short hash per field in flag order:
    what an elastic run on torchft compares between workers that share no key-value store (each worker's
    prints travel in its torchft replica id to every member of each quorum: jaxdp/elastic/ft.py)."""
    return "".join(hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:PRINT_HEX]
                   for value in agreed_fields(config).values())


def first_differing(mine: str, theirs: str) -> str | None:
    """The flag (--name) of the first field whose print differs between two `prints`, or None where
    they are equal; "their jaxdp versions" where the two list different fields."""
    if mine == theirs:
        return None
    names = list(agreed_fields(Config()))
    if len(mine) != len(theirs) or len(mine) != PRINT_HEX * len(names):
        return "their jaxdp versions"
    index = next(i for i in range(0, len(mine), PRINT_HEX) if mine[i:i + PRINT_HEX] != theirs[i:i + PRINT_HEX])
    return "--" + names[index // PRINT_HEX].replace("_", "-")


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


def load_dataset(load: Callable[[], Any], process: int, count: int, client: Any = None, *,
                 wait_s: float = INPUTS_WAIT_S) -> Any:
    """`load()` on this process (a `jaxdp.data.datasets` dataset), agreed with every other process.

    Returns the dataset when every process loaded the same data. Otherwise raises on every process
    alike: InputError naming the process(es) whose input is bad and why, or the processes whose
    data differ; a RuntimeError naming a process that failed for another reason (that process
    re-raises its own error). One process: `load()` as it is. `client`: JAX's coordination client
    (default: this run's)."""
    if count == 1:
        return load()
    if client is None:
        from jaxdp.cluster.coordination import client as coordination_client

        client = coordination_client()
    error: BaseException | None = None
    dataset = None
    try:
        dataset = load()
        mine: dict[str, Any] = {"fingerprint": dataset.fingerprint()}
    except InputError as err:
        error, mine = err, {"error": str(err), "argument": err.argument, "setting": err.setting}
    except Exception as err:  # noqa: BLE001 - published, so that the others stop too; re-raised below
        error, mine = err, {"failed": f"{type(err).__name__}: {err}"}
    everyone = gather(client, _INPUTS_KEY, process, count, mine, wait_s)
    if error is not None and "failed" in mine:
        raise error
    failed = [p for p, record in enumerate(everyone) if "failed" in record]
    if failed:
        raise RuntimeError(f"process {failed[0]} (of {count}) could not load its dataset: {everyone[failed[0]]['failed']}")
    bad = [p for p, record in enumerate(everyone) if "error" in record]
    if bad:
        first = everyone[bad[0]]
        alike = all(everyone[p]["error"] == first["error"] for p in bad)
        who = ("every process" if len(bad) == count and alike else
               f"process {bad[0]} (of {count})" if len(bad) == 1 or not alike else f"processes {_listed(bad)} (of {count})")
        also = "" if alike or len(bad) == 1 else f" (and processes {_listed(bad[1:])} with other errors)"
        raise InputError(f"on {who}: {first['error']}{also}", argument=first["argument"], setting=first["setting"])
    prints = [record["fingerprint"] for record in everyone]
    if any(p != prints[0] for p in prints):
        groups: dict[str, list[int]] = {}
        for p, fingerprint in enumerate(prints):
            groups.setdefault(json.dumps(fingerprint, sort_keys=True), []).append(p)
        each = "; ".join(f"process{'es' if len(ps) > 1 else ''} {_listed(ps)}: {prints[ps[0]]['what']}"
                         for ps in groups.values())
        same_size = len({fingerprint["what"] for fingerprint in prints}) == 1
        raise InputError(f"the processes read different data ({each}{', different contents' if same_size else ''}); "
                         f"every process must read the same data: a shared file system, or identical copies",
                         argument="dataset")
    return dataset


def gather(client: Any, namespace: str, process: int, count: int, record: dict, wait_s: float) -> list[dict]:
    """Publish this process's JSON `record` under `namespace<process>` and return every process's,
    in process order, once all have published (RuntimeError naming the missing after `wait_s`)."""
    client.key_value_set(f"{namespace}{process}", json.dumps(record))
    deadline = time.monotonic() + wait_s
    while True:
        found = {int(key.rsplit("/", 1)[1]): value for key, value in client.key_value_dir_get(namespace)}
        if len(found) == count:
            return [json.loads(found[p]) for p in range(count)]
        if time.monotonic() > deadline:
            missing = sorted(set(range(count)) - set(found))
            raise RuntimeError(f"process(es) {_listed(missing)} did not get as far as publishing {namespace!r} "
                               f"within {wait_s:g} s")
        time.sleep(0.05)


def _listed(processes: list[int]) -> str:
    return ", ".join(map(str, processes))
