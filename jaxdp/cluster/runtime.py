"""Process-wide JAX settings the command line makes before it compiles anything.

* JAX's persistent compilation cache, on by default for `python -m jaxdp.train`: a second run of
  the same program loads its compiled steps from disk instead of compiling them again
  (`--compile-cache DIR`, `auto` or `off`). Several processes may share one directory.
  Across CPU processes the cache needs one fix (`share_cpu_cache_keys`): JAX keys each program by
  a CPU "topology" fingerprint that differs from process to process, while only process 0 writes
  entries, so every other process missed every time and compiled everything itself on every run.
* XLA flags for data parallelism on GPUs, each kept for a documented effect (README "Performance").
  Flags the user already set in XLA_FLAGS win.
* Two CPU worker threads for a process bound to one core, when it overlaps a collective with
  compute (`two_cpu_workers`, for `--overlap`).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

CACHE_ENV = "JAXDP_COMPILE_CACHE"  # the directory `--compile-cache auto` uses, when set

# flag -> value, with the reason. Only flags with a documented effect on data-parallel training:
GPU_XLA_FLAGS = {
    # Lets XLA schedule the gradient all-reduce's start early and its end late, so NCCL runs while
    # the rest of the backward pass computes (JAX's GPU performance tips; on by default in
    # NVIDIA's JAX containers). On one GPU, where there is no collective, the step took the same
    # time with it and without, within the noise (docs/performance.md, "A second lease").
    "--xla_gpu_enable_latency_hiding_scheduler": "true",
}
# Left at XLA's defaults, for want of a measurement that justifies a change: the all-reduce
# combine threshold (the step already fuses its gradients into one buffer per dtype for the
# ring, and XLA combines psum's leaves itself), and CUDA_DEVICE_MAX_CONNECTIONS (it orders
# kernels for tensor-parallel overlap, which data parallelism does not do, and NVIDIA advises
# against it on Blackwell).


def cache_directory(setting: str) -> str | None:
    """`--compile-cache` to a directory: a path, `auto` ($JAXDP_COMPILE_CACHE, else the user's
    cache directory), or None for `off`."""
    if setting == "off":
        return None
    if setting != "auto":
        return os.path.abspath(os.path.expanduser(setting))
    if os.environ.get(CACHE_ENV):
        return os.path.abspath(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return os.path.join(base, "jaxdp", "xla")


def enable_compile_cache(setting: str) -> str | None:
    """Point JAX's persistent compilation cache at `cache_directory(setting)`; returns it.

    Every compiled program is cached, however quickly it compiled (JAX's default skips programs
    that compile in under a second: on a laptop that is most of a small model's steps). A
    directory that cannot be created turns the cache off with a warning; it never stops a run.
    """
    import jax

    directory = cache_directory(setting)
    if directory is None:
        return None
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        import logging

        logging.getLogger("jaxdp").warning("jaxdp: warning: compilation cache %s unusable (%s); compiling "
                                           "without it", directory, err.strerror or err)
        return None
    if jax.config.jax_compilation_cache_dir not in (None, directory):
        try:  # a process that already used another cache directory (a notebook, a test session)
            from jax._src import compilation_cache

            compilation_cache.reset_cache()
        except (ImportError, AttributeError):
            pass
    share_cpu_cache_keys()
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


def share_cpu_cache_keys() -> bool:
    """Key CPU programs by their devices (global ids, owning processes, kind) instead of XLA's CPU
    topology fingerprint, so every process of a multi-process CPU run finds the entries process 0
    wrote (JAX writes persistent-cache entries from process 0 only).

    On the slow-link testbed (2 processes, the GPT of `bench compression`) process 1 never hit the
    cache and compiled the controller's quality program on every run, many times longer than
    process 0 took to load it, while process 0 waited (docs/performance.md, "Behind the defaults").
    The program is the same SPMD program in every process, and an executable serialized by one
    process runs in another (JAX's own `jax_share_binary_between_hosts` ships executables from
    process 0 the same way); the key still holds every device's id, process and kind, so another
    device layout gets its own entry. Each process writes the entries of the programs on its own
    devices alone (_write_process_local_cpu_entries). Other platforms keep JAX's key. Returns False
    where this JAX has no such hook (nothing changes).
    """
    try:
        from jax._src import cache_key
    except ImportError:
        return False
    original = getattr(cache_key, "_hash_accelerator_config", None)
    if original is None:
        return False
    if getattr(original, "_jaxdp_cpu_keys", False):
        return True

    def hash_accelerator_config(hash_obj, accelerators):  # noqa: ANN001 - JAX's private signature
        devices = list(getattr(accelerators, "flat", accelerators))
        if not devices or any(d.platform != "cpu" for d in devices):
            return original(hash_obj, accelerators)
        for d in devices:
            hash_obj.update(f"{d.platform}:{d.id}:{d.process_index}:{d.device_kind};".encode())

    hash_accelerator_config._jaxdp_cpu_keys = True
    cache_key._hash_accelerator_config = hash_accelerator_config
    _write_process_local_cpu_entries()
    return True


def _write_process_local_cpu_entries() -> None:
    """Let every process write the cache entries of its own CPU programs: those on its devices
    alone (the model's initialisation, a batch's placement, ...). JAX writes entries from process 0
    only; on CPUs such a program's key holds the devices' global ids, so process 0 never writes the
    entry process 1 looks for, and process 1 compiled them again on every run while process 0 waited
    at the first collective (most of a 2-process MLP run's programs; docs/performance.md, "Behind
    the defaults"). Programs over several processes' devices stay process 0's to write, as JAX has
    it."""
    from jax._src import compilation_cache, compiler, config, distributed

    original = getattr(compiler, "_compile_and_write_cache", None)
    if original is None or getattr(original, "_jaxdp_local_entries", False):
        return

    def compile_and_write_cache(backend, computation, executable_devices, compile_options, host_callbacks,
                                module_name, cache_key):  # noqa: ANN001 - JAX's private signature
        started = time.monotonic()
        executable = original(backend, computation, executable_devices, compile_options, host_callbacks,
                              module_name, cache_key)
        seconds = time.monotonic() - started
        if (distributed.global_state.process_id and backend.platform == "cpu" and not host_callbacks
                and getattr(executable_devices, "is_fully_addressable", False)
                and seconds >= config.persistent_cache_min_compile_time_secs.value):
            try:
                compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend, int(seconds))
            except Exception:  # noqa: BLE001 - a cache that cannot be written costs a compile, never a run
                pass
        return executable

    compile_and_write_cache._jaxdp_local_entries = True
    compiler._compile_and_write_cache = compile_and_write_cache


def add_gpu_xla_flags(environ: "os._Environ | dict" = os.environ) -> list[str]:
    """Add GPU_XLA_FLAGS to XLA_FLAGS (before JAX starts its backend); returns the flags added.
    A flag already in XLA_FLAGS keeps the user's value. CPU builds of XLA accept and ignore them."""
    current = environ.get("XLA_FLAGS", "")
    added = [f"{flag}={value}" for flag, value in GPU_XLA_FLAGS.items() if flag not in current]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


class CacheHits:
    """Counts the compiled programs this process loaded from the persistent cache."""

    def __init__(self) -> None:
        import jax.monitoring

        self.hits = 0
        jax.monitoring.register_event_listener(self._on_event)

    def _on_event(self, event: str, **kwargs: object) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.hits += 1

    def close(self) -> None:
        import jax.monitoring

        try:
            jax.monitoring.unregister_event_listener(self._on_event)
        except (AssertionError, ValueError):
            pass


@contextlib.contextmanager
def two_cpu_workers(wanted: bool = True):
    """Start JAX's CPU backend inside this block with at least two worker threads, then bind every
    thread back to the process's cores.

    XLA's CPU client sizes its thread pool from the process's CPU affinity when the backend starts.
    A process bound to one core (jaxdp.launch on a CPU host, the testbed) gets one worker: a
    collective program waiting on the network holds it, and a compute program dispatched from
    another thread waits for it, so `--overlap` overlaps nothing (`python -m jaxdp.bench dispatch`:
    both programs took longer than the longer one: docs/performance.md, "Behind the defaults"). With
    a second core in the mask while the backend starts, then every thread bound back to the one core,
    they run together: the waiting worker needs no CPU. Nothing happens with two or more cores, on a machine with one, or
    when `wanted` is False.
    """
    mine = os.sched_getaffinity(0) if wanted and hasattr(os, "sched_setaffinity") else set()
    extra = None
    if len(mine) == 1:
        try:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))  # (the kernel keeps it within the cpuset)
            extra = next(iter(sorted(os.sched_getaffinity(0) - mine)), None)
            os.sched_setaffinity(0, mine if extra is None else mine | {extra})
        except OSError:
            extra = None
    try:
        yield
    finally:
        if extra is not None:  # every thread started meanwhile (XLA's workers) back on the one core
            for tid in os.listdir("/proc/self/task"):
                try:
                    os.sched_setaffinity(int(tid), mine)
                except OSError:
                    pass
