"""Benchmarks: the all-reduce strategies, the train step, and jaxdp against PyTorch DDP.

    python -m jaxdp.bench collectives --devices 8 --sizes 1KB,64KB,1MB,16MB,64MB --json c.json --plot c.png
    python -m jaxdp.bench train --devices 1,8 --json t.json
    python -m jaxdp.bench train --devices 1 --coordinator-address 127.0.0.1:PORT --num-processes 2 --process-id I
    python -m jaxdp.bench ddp --json d.json        # needs torch: pip install -e '.[bench]'
    python -m jaxdp.bench gpt --json g.json        # on a GPU: bf16 GPT-2-small step, tokens/s, MFU

collectives: for every entry of jaxdp.STRATEGIES, the time of one all-reduce (mean) of a float32
    buffer of each size per device; in-graph strategies run inside a jitted shard_map, on-host
    ones (@on_host) are timed over their whole device -> host -> device path. algbw = bytes / time,
    busbw = algbw * 2 (N - 1) / N (the nccl-tests convention).
train: steps/s and examples/s of jaxdp.make_train_step for every strategy and device count, and,
    in the same run, two hand-written baselines on the same model and batches: a plain
    single-device `jax.jit` step and a `shard_map` + `pmean` step. The time ratios jaxdp/baseline
    are jaxdp's overhead.
ddp: jaxdp's train step in 2 processes x 1 device (gloo) against PyTorch DistributedDataParallel
    in 2 processes (gloo, 1 thread each) on the same MLP 784-512-512-10, float32, global batch 256,
    Adam, reported as a steps/s ratio. Each side launches its own 2 processes, each pinned to its
    own core (--no-pin: not); the launches alternate.
gpt: a GPT-style decoder (default: GPT-2 small, 124M parameters, sequence 1024) trained with
    AdamW through make_train_step, bfloat16 compute: tokens/s, achieved TFLOP/s and MFU = model
    FLOPs per step (6 per non-embedding weight per token plus attention, PaLM's count; XLA's own
    count is printed beside it) / step time / (peak x devices). Peaks are known for H100, H200
    and A100 in bf16; elsewhere pass --peak-tflops. Meant for a GPU; on CPU use a tiny model.

Method: every figure is the median over --repeats; configurations are interleaved within each
repeat, in an order that rotates from repeat to repeat, so background load hits all of them
alike. Every ratio is paired: the median over repeats (ddp: rounds) of the ratio of two cases'
times in the same repeat. Python's garbage collector is paused while timing. One "step" time is
the wall time of --steps back-to-back steps / --steps, after warm-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
MLP_HIDDEN = (512, 512)  # MLP 784-512-512-10: the model of the DDP comparison
TORCH_HINT = "PyTorch is not installed; install the benchmark extra: pip install -e '.[bench]' (torch==2.13.0, CPU)"


def parse_size(text: str) -> int:
    """'64KB' -> 65536 (binary units)."""
    text = text.strip().upper()
    for unit in sorted(UNITS, key=len, reverse=True):
        if text.endswith(unit) and text[:-len(unit)].replace(".", "", 1).isdigit():
            return int(float(text[:-len(unit)]) * UNITS[unit])
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"size {text!r} is not like 1KB, 64KB, 1MB, 16MB")


def human(nbytes: int) -> str:
    for unit in ("GB", "MB", "KB"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit}"
    return f"{nbytes}B"


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(cases: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of each case: `repeats` rounds, every case once per round, in an order
    that rotates from round to round (the case run first after another one may find caches cold)."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotate: no case always first
                times[name].append(timed(cases[name]))
    finally:
        gc.enable()
    return times


def paired_ratio(times: list[float], baseline: list[float]) -> float:
    """Median over repeats of time / baseline time in the same repeat (both ran back to back, so
    a load change that slows one repeat divides out)."""
    return statistics.median(t / b for t, b in zip(times, baseline, strict=True))


LOAD_AT_START = os.getloadavg()  # 1, 5, 15-minute load averages when this process started


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    import jax
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
            "loadavg_at_start": LOAD_AT_START, "loadavg_at_end": os.getloadavg(), "malloc_env": {k: os.environ.get(k) for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")},
            "command": " ".join(["python", "-m", "jaxdp.bench", *sys.argv[1:]])}


def write_json(path: str | None, results: list[dict], **extra: Any) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"results": results, "machine": machine(), **extra}, f, indent=1)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format); a key ending in "_s" with header "... ms" prints milliseconds."""
    def cell(row: dict, key: str, header: str, fmt: str) -> str:
        value = row.get(key)
        if value is None:
            return "-"
        return format(value * 1e3 if header.endswith("ms") else value, fmt)
    cells = [[cell(row, *column) for column in columns] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(columns)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


# ---------------------------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------------------------


def bench_collectives(args: argparse.Namespace) -> list[dict]:
    import jax
    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jaxdp.mesh import DATA_AXIS, make_mesh, replicate, shard_batch
    from jaxdp.sync import STRATEGIES, runs_on_host

    if len(jax.devices()) < args.devices:
        raise SystemExit(f"jaxdp.bench: asked for {args.devices} devices, JAX has {len(jax.devices())}")
    mesh = make_mesh(jax.devices()[:args.devices])
    n = mesh.size
    strategies = args.strategies or list(STRATEGIES)

    def in_graph(strategy: Callable) -> Callable:
        body = lambda x: strategy({"grad": x[0]}, DATA_AXIS)["grad"][None]  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS), check_vma=False))

    def on_host(strategy: Callable) -> Callable:
        def run(x):  # the whole path: every device -> host, numpy mean, host -> every device
            shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start)
            local = jax.device_get([s.data for s in shards])
            return replicate(strategy([{"grad": a[0]} for a in local], num_devices=n), mesh)
        return run

    def ring_hops_only(tree: Any, axis_name: str) -> Any:
        """Diagnostic floor of any ring here: its 2 (N-1) hops of 1/N of the buffer, nothing else."""
        (x,) = jax.tree.leaves(tree)
        chunk = x[:-(-x.shape[0] // n)]
        for _ in range(2 * (n - 1)):
            chunk = jax.lax.ppermute(chunk, DATA_AXIS, [(j, (j + 1) % n) for j in range(n)])
        return {"grad": jax.numpy.resize(chunk, x.shape)}

    if args.ring_floor:
        strategies.append("ring-hops-only")
    registry = {**STRATEGIES, "ring-hops-only": ring_hops_only}
    results = []
    for nbytes in args.sizes:
        x = shard_batch(np.random.default_rng(0).standard_normal((n, max(1, nbytes // 4)), dtype=np.float32), mesh)
        calls = {}
        for name in strategies:
            fn = on_host(registry[name]) if runs_on_host(registry[name]) else in_graph(registry[name])
            calls[name] = lambda fn=fn, x=x: jax.block_until_ready(fn(x))
        times = interleaved(calls, args.repeats)
        for name in strategies:
            median = statistics.median(times[name])
            algbw = nbytes / median / 1e9
            results.append({"strategy": name, "devices": n, "bytes": nbytes, "size": human(nbytes),
                            "median_s": median, "min_s": min(times[name]), "repeats": args.repeats,
                            "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (n - 1) / n,
                            # psum's time / this one's, paired within each repeat
                            "busbw_vs_psum": 1 / paired_ratio(times[name], times["psum"]) if "psum" in times else None})
        del x, calls  # free this size's buffers before the next size allocates its own

    print(f"all-reduce (mean) of a float32 buffer per device, {n} devices, median of {args.repeats}")
    print_table(results, [("strategy", "strategy", "s"), ("size", "size", "s"), ("median_s", "time ms", ".3f"),
                          ("algbw_gbps", "algbw GB/s", ".3f"), ("busbw_gbps", "busbw GB/s", ".3f"),
                          ("busbw_vs_psum", "x psum", ".2f")])
    write_json(args.json, results)
    if args.plot:
        plot_collectives(results, args.plot, n)
    return results


def plot_collectives(results: list[dict], path: str, n: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in dict.fromkeys(r["strategy"] for r in results):
        rows = [r for r in results if r["strategy"] == name]
        ax.plot([r["bytes"] for r in rows], [r["busbw_gbps"] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    sizes = sorted({r["bytes"] for r in results})
    ax.set_xticks(sizes, [human(s) for s in sizes])
    ax.set_xlabel("buffer size per device")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"all-reduce busbw, {n} CPU devices, {os.cpu_count()} cores")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------


def bench_train(args: argparse.Namespace) -> list[dict]:
    from jaxdp import distributed
    from jaxdp.config import Config

    # The CLI's own start-up: the simulated device count and jax.distributed come from a Config.
    config = Config(devices=max(args.devices), coordinator_address=args.coordinator_address,
                    num_processes=args.num_processes, process_id=args.process_id, progress=False)
    distributed.initialize(config)

    import jax
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    from jaxdp import models
    from jaxdp.mesh import DATA_AXIS, make_mesh, replicate, shard_batch
    from jaxdp.state import init_state
    from jaxdp.step import make_train_step
    from jaxdp.sync import STRATEGIES

    n_proc, proc = jax.process_count(), jax.process_index()
    model = models.MLP(hidden=MLP_HIDDEN, num_classes=10)
    tx = optax.adam(1e-3)
    rng = np.random.default_rng(0)
    host_batches = [{"x": rng.standard_normal((args.batch_size, 784), dtype=np.float32),
                     "y": rng.integers(0, 10, args.batch_size).astype(np.int32)} for _ in range(4)]
    local = lambda b: jax.tree.map(lambda a: a[proc * len(a) // n_proc:(proc + 1) * len(a) // n_proc], b)  # noqa: E731
    params = model.init(jax.random.PRNGKey(0), host_batches[0]["x"][:1])["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def loop(step: Callable, carry: Any, batches: list, bounded: bool) -> Callable[[], None]:
        """Run --steps steps from the current carry; `bounded`: wait for step k-1 before k."""
        def run():
            nonlocal carry
            previous = None
            for i in range(args.steps):
                if bounded:
                    jax.block_until_ready(previous)
                *carry, loss = step(*carry, batches[i % len(batches)])
                previous = loss
            jax.block_until_ready((carry, previous))
        return run

    def jaxdp_case(strategy: str, mesh) -> Callable[[], None]:
        step = make_train_step(loss_fn, tx, mesh, strategy)
        state = init_state(params, tx, mesh)
        batches = [shard_batch(local(b), mesh) for b in host_batches]
        wrapped = lambda state, batch: (lambda out: (out[0], out[1]["loss"]))(step(state, batch))  # noqa: E731
        return loop(wrapped, [state], batches, bounded=False)  # make_train_step bounds itself

    def plain_jit_case() -> Callable[[], None]:  # hand-written single-device baseline
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        device = jax.local_devices()[0]
        p = jax.device_put(params, device)
        step = jax.jit(step, donate_argnums=(0, 1))
        batches = [jax.device_put(b, device) for b in host_batches]
        return loop(step, [p, tx.init(p)], batches, bounded=False)

    def shard_map_case(mesh) -> Callable[[], None]:  # hand-written data-parallel baseline
        def device_step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)  # per device (check_vma=False)
            grads, loss = jax.lax.pmean((grads, loss), DATA_AXIS)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        step = jax.jit(jax.shard_map(device_step, mesh=mesh, in_specs=(P(), P(), P(DATA_AXIS)),
                                     out_specs=(P(), P(), P()), check_vma=False), donate_argnums=(0, 1))
        p = replicate(params, mesh)
        opt_state = jax.jit(tx.init, out_shardings=jax.sharding.NamedSharding(mesh, P()))(p)
        batches = [shard_batch(local(b), mesh) for b in host_batches]
        # The same protection as jaxdp's step: with several steps queued, XLA's CPU collectives
        # can deadlock (see jaxdp/step.py), so a multi-device CPU baseline keeps one step in flight.
        return loop(step, [p, opt_state], batches, bounded=mesh.size > 1 and mesh.devices.flat[0].platform == "cpu")

    cases: dict[tuple, Callable[[], None]] = {}
    for n in args.devices:
        mesh = make_mesh(distributed.global_devices(config.replace(devices=n)))
        if args.batch_size % mesh.size:
            raise SystemExit(f"jaxdp.bench: --batch-size {args.batch_size} is not divisible by {mesh.size} devices")
        if mesh.size == 1:
            cases[("jit", "-", 1)] = plain_jit_case()
        cases[("shard_map+pmean", "-", mesh.size)] = shard_map_case(mesh)
        for strategy in args.strategies or list(STRATEGIES):
            cases[("jaxdp", strategy, mesh.size)] = jaxdp_case(strategy, mesh)

    times = interleaved(cases, args.repeats, warmup=1)
    results = []
    for (impl, strategy, n), seconds in times.items():
        step_s = statistics.median(seconds) / args.steps
        results.append({"impl": impl, "strategy": strategy, "devices": n, "processes": n_proc,
                        "global_batch": args.batch_size, "model": "mlp-784-512-512-10", "optimizer": "adam",
                        "step_s": step_s, "steps_per_s": 1 / step_s, "examples_per_s": args.batch_size / step_s,
                        "repeats": args.repeats, "steps_per_repeat": args.steps,
                        "vs_shard_map": paired_ratio(seconds, times["shard_map+pmean", "-", n]),
                        "vs_jit": paired_ratio(seconds, times["jit", "-", 1]) if n == 1 else None})
    if proc == 0:
        print(f"train step, MLP 784-512-512-10, adam, global batch {args.batch_size}, {n_proc} process(es), "
              f"median of {args.repeats} x {args.steps} steps")
        print_table(results, [("impl", "impl", "s"), ("strategy", "strategy", "s"), ("devices", "devices", "d"),
                              ("step_s", "step ms", ".3f"), ("steps_per_s", "steps/s", ".1f"),
                              ("examples_per_s", "examples/s", ".0f"), ("vs_shard_map", "x shard_map", ".3f"),
                              ("vs_jit", "x jit", ".3f")])
        write_json(args.json, results)
    return results


# ---------------------------------------------------------------------------------------------
# gpt: a GPT-style transformer's train step, with its model FLOPs utilisation (MFU)
# ---------------------------------------------------------------------------------------------

# Dense bfloat16 peak of one device, TFLOP/s, by a substring of jax's `device_kind` (vendor data
# sheets, SXM parts, without sparsity). Other devices need --peak-tflops for an MFU.
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def peak_tflops(device: Any, dtype: str, override: float | None) -> float | None:
    if override:
        return override
    if dtype != "bfloat16":
        return None
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device.device_kind), None)


def bench_gpt(args: argparse.Namespace) -> list[dict]:
    from jaxdp import distributed
    from jaxdp.config import Config

    config = Config(devices=args.devices, progress=False)
    distributed.initialize(config)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxdp.mesh import make_mesh, shard_batch
    from jaxdp.models import GPT
    from jaxdp.state import init_state
    from jaxdp.step import make_train_step

    mesh = make_mesh(distributed.global_devices(config))
    if args.batch_size % mesh.size:
        raise SystemExit(f"jaxdp.bench: --batch-size {args.batch_size} is not divisible by {mesh.size} devices")
    model = GPT(vocab_size=args.vocab_size, seq_len=args.seq_len, layers=args.layers, d_model=args.d_model,
                heads=args.heads, dtype=jnp.dtype(args.dtype))
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, args.vocab_size, (args.batch_size, args.seq_len + 1)).astype(np.int32) for _ in range(2)]
    batches = [shard_batch({"x": t[:, :-1], "y": t[:, 1:]}, mesh) for t in tokens]
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens[0][:1, :-1])["params"]
    tx = optax.adamw(3e-4, weight_decay=0.1)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step = make_train_step(loss_fn, tx, mesh, args.strategy)
    state = init_state(params, tx, mesh)
    compiled = getattr(step, "jitted", step).lower(state, batches[0]).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla_flops = float(cost.get("flops", 0.0)) * mesh.size if cost else None  # the per-device program's count

    def run():
        nonlocal state
        for i in range(args.steps):
            state, metrics = step(state, batches[i % 2])
        jax.block_until_ready((state, metrics))

    seconds = interleaved({"gpt": run}, args.repeats, warmup=1)["gpt"]
    step_s = statistics.median(seconds) / args.steps
    tokens_per_step = args.batch_size * args.seq_len
    flops = model.flops_per_token(params) * tokens_per_step
    device = mesh.devices.flat[0]
    peak = peak_tflops(device, args.dtype, args.peak_tflops)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    result = {"model": f"gpt-{args.layers}x{args.d_model}", "params": n_params, "dtype": args.dtype,
              "strategy": args.strategy, "devices": mesh.size, "device_kind": device.device_kind,
              "global_batch": args.batch_size, "seq_len": args.seq_len, "step_s": step_s,
              "tokens_per_s": tokens_per_step / step_s, "model_tflops_per_step": flops / 1e12,
              "xla_tflops_per_step": xla_flops / 1e12 if xla_flops else None,
              "achieved_tflops": flops / step_s / 1e12, "peak_tflops_per_device": peak,
              "mfu": flops / step_s / (peak * 1e12 * mesh.size) if peak else None,
              "repeats": args.repeats, "steps_per_repeat": args.steps}
    print(f"GPT train step ({result['model']}, {n_params / 1e6:.1f}M parameters, {args.dtype}, AdamW), "
          f"global batch {args.batch_size} x {args.seq_len} tokens, {mesh.size} x {device.device_kind}, "
          f"median of {args.repeats} x {args.steps} steps")
    print_table([result], [("step_s", "step ms", ".2f"), ("tokens_per_s", "tokens/s", ".0f"),
                           ("model_tflops_per_step", "model TFLOP/step", ".4g"),
                           ("xla_tflops_per_step", "XLA TFLOP/step", ".4g"),
                           ("achieved_tflops", "TFLOP/s", ".4g"), ("mfu", "MFU", ".3f")])
    if peak is None:
        print(f"no MFU: no known {args.dtype} peak for {device.device_kind!r}; pass --peak-tflops")
    write_json(args.json, [result])
    return [result]


# ---------------------------------------------------------------------------------------------
# ddp: jaxdp (2 processes x 1 device) against PyTorch DDP (2 processes), alternating
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_pair(argv: list[str], timeout: float) -> dict:
    """Start `python -m jaxdp.bench *argv --process-id i` for i in 0, 1; return process 0's JSON."""
    out = f"/tmp/jaxdp-bench-{os.getpid()}-{time.monotonic_ns()}.json"
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "jaxdp.bench", *argv, "--port", port, "--rank", str(i)]
                              + (["--json", out] if i == 0 else []), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"jaxdp.bench: a worker failed ({' '.join(argv)}):\n" + "\n".join(outputs))
    with open(out) as f:
        data = json.load(f)
    os.remove(out)
    return data


def bench_ddp(args: argparse.Namespace) -> list[dict]:
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"jaxdp.bench: {TORCH_HINT}", file=sys.stderr)
        raise SystemExit(2)
    common = ["--steps", str(args.steps), "--repeats", str(args.repeats), "--batch-size", str(args.batch_size)]
    common += [] if args.pin else ["--no-pin"]
    runs: dict[tuple[str, str], list[float]] = {}  # (impl, strategy) -> steps/s of each round
    for _ in range(args.rounds):  # alternate, so load changes hit both sides
        for r in launch_pair(["train-worker", "--strategies", ",".join(args.strategies), *common], args.timeout)["results"]:
            runs.setdefault((r["impl"], r["strategy"]), []).append(r["steps_per_s"])
        for r in launch_pair(["ddp-worker", *common], args.timeout)["results"]:
            runs.setdefault(("pytorch-ddp", "gloo"), []).append(r["steps_per_s"])
    ddp = runs[("pytorch-ddp", "gloo")]
    results = []
    for (impl, strategy), values in runs.items():
        steps_per_s = statistics.median(values)
        results.append({"impl": impl, "strategy": strategy, "processes": 2, "devices": 2, "global_batch": args.batch_size,
                        "model": "mlp-784-512-512-10", "dtype": "float32", "optimizer": "adam",
                        "steps_per_s": steps_per_s, "examples_per_s": steps_per_s * args.batch_size,
                        "step_s": 1 / steps_per_s, "vs_ddp": 1 / paired_ratio(ddp, values), "rounds": values})
    print(f"2 processes{' x 1 core' if args.pin else ' (not pinned)'}, MLP 784-512-512-10, adam, float32, global batch {args.batch_size}; median of "
          f"{args.rounds} alternating rounds, each the median of {args.repeats} x {args.steps} steps")
    print_table(results, [("impl", "impl", "s"), ("strategy", "strategy", "s"), ("step_s", "step ms", ".3f"),
                          ("steps_per_s", "steps/s", ".1f"), ("examples_per_s", "examples/s", ".0f"),
                          ("vs_ddp", "x DDP steps/s", ".2f")])
    write_json(args.json, results, torch=torch.__version__, pinned=args.pin)
    return results


def pin_to_one_core(rank: int) -> None:
    """Give process `rank` its own core (before JAX / torch start their thread pools).

    Two processes that each size their thread pool to every core of the machine fight over the
    cores; with one core each, XLA's CPU client makes a 1-thread pool (it sizes its pool from the
    affinity mask) and torch runs its 1 thread undisturbed. Both sides of the comparison get this.
    """
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def train_worker(args: argparse.Namespace) -> list[dict]:
    """One jaxdp process of the ddp comparison: `bench train` with 1 device in 2 processes."""
    if args.pin:
        pin_to_one_core(args.rank)
    args.devices = [1]
    args.coordinator_address, args.num_processes, args.process_id = f"127.0.0.1:{args.port}", 2, args.rank
    return bench_train(args)


def ddp_worker(args: argparse.Namespace) -> list[dict]:
    """One PyTorch DDP process: gloo, 1 thread, the same MLP, batches and optimizer."""
    if args.pin:
        pin_to_one_core(args.rank)
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)  # 2 processes on the machine's cores, like jaxdp's 2 x 1 device
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, MLP_HIDDEN[0]), torch.nn.ReLU(),
                                torch.nn.Linear(*MLP_HIDDEN), torch.nn.ReLU(), torch.nn.Linear(MLP_HIDDEN[1], 10))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    rng, rows = np.random.default_rng(0), slice(args.rank * args.batch_size // 2, (args.rank + 1) * args.batch_size // 2)
    batches = [(torch.from_numpy(rng.standard_normal((args.batch_size, 784), dtype=np.float32)[rows]),
                torch.from_numpy(rng.integers(0, 10, args.batch_size)[rows])) for _ in range(4)]

    def run():
        for i in range(args.steps):
            x, y = batches[i % len(batches)]
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
        dist.barrier()

    seconds = interleaved({"ddp": run}, args.repeats, warmup=1)["ddp"]
    step_s = statistics.median(seconds) / args.steps
    results = [{"impl": "ddp", "steps_per_s": 1 / step_s, "step_s": step_s}]
    if args.rank == 0:
        write_json(args.json, results, torch=torch.__version__)
    dist.destroy_process_group()
    return results


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxdp.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("collectives", help="all-reduce time, algbw and busbw per strategy and size")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--sizes", type=lambda t: [parse_size(v) for v in t.split(",")],
                   default=[parse_size(v) for v in "1KB,64KB,1MB,16MB,64MB".split(",")], help="bytes per device, e.g. 1KB,64MB")
    p.add_argument("--strategies", type=lambda t: t.split(","), default=None, help="default: all of jaxdp.STRATEGIES")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--ring-floor", action="store_true", help="also time a diagnostic: only the ring's 2(N-1) ppermute hops")
    p.add_argument("--json", help="write {'results': [...], 'machine': {...}} here")
    p.add_argument("--plot", help="write a PNG of busbw vs size here")
    p.set_defaults(run=bench_collectives)

    p = sub.add_parser("gpt", help="a GPT-style model's train step: tokens/s and MFU (for GPUs)")
    p.add_argument("--devices", type=int, default=1, help="devices (simulated on CPU; default 1)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--batch-size", type=int, default=16, help="global batch size, in sequences")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype (parameters stay float32)")
    p.add_argument("--strategy", default="psum")
    p.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, help="one device's peak for the MFU (default: known GPUs, bf16)")
    p.add_argument("--json")
    p.set_defaults(run=bench_gpt)

    for name, run in (("train", bench_train), ("train-worker", train_worker), ("ddp", bench_ddp), ("ddp-worker", ddp_worker)):
        p = sub.add_parser(name, help={"train": "steps/s of jaxdp's step and of hand-written baselines",
                                       "ddp": "jaxdp 2-process training vs PyTorch DDP (needs torch)"}.get(name, argparse.SUPPRESS))
        p.add_argument("--steps", type=int, default=100, help="steps per timed repeat")
        p.add_argument("--repeats", type=int, default=7)
        p.add_argument("--batch-size", type=int, default=256, help="global batch size")
        p.add_argument("--json")
        if name in ("train", "train-worker"):
            p.add_argument("--strategies", type=lambda t: t.split(","), default=None)
        if name == "train":
            p.add_argument("--devices", type=int_list, default=[1, 8], help="device counts per process, e.g. 1,2,8")
            p.add_argument("--coordinator-address")
            p.add_argument("--num-processes", type=int)
            p.add_argument("--process-id", type=int)
        if name == "ddp":
            p.add_argument("--strategies", type=lambda t: t.split(","), default=["psum", "ring"])
            p.add_argument("--rounds", type=int, default=3, help="alternating jaxdp / DDP launches")
            p.add_argument("--timeout", type=float, default=600)
        if name.startswith("ddp") or name == "train-worker":
            p.add_argument("--no-pin", dest="pin", action="store_false",
                           help="do not give each process its own core (both sides)")
        if name.endswith("worker"):
            p.add_argument("--port", type=int, required=True)
            p.add_argument("--rank", type=int, required=True)
        p.set_defaults(run=run)

    args = parser.parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
