"""collectives: for every entry of jaxdp.registry.STRATEGIES, the time of one all-reduce (mean)
of a float32 buffer of each size per device; in-graph strategies run inside a jitted shard_map,
on-host ones (@on_host) are timed over their whole device -> host -> device path. algbw = bytes /
time, busbw = algbw * 2 (N - 1) / N (the nccl-tests convention).

With --reduce-scatter: instead, the time of one reduce-scatter (sum) of a float32 buffer of each size
per device (device i keeps chunk i, 1/N of it) three ways: XLA's `psum_scatter`, an
all-reduce then this device's chunk, and the ring's own (`ring_reduce_scatter`, N - 1 ppermute
hops: what `jaxdp.sync.collectives.psum_scatter` runs instead of XLA's on CPU across processes, where gloo's
reduce-scatter is wrong now and then). Also under jax.distributed, each process with --devices devices:

    python -m jaxdp.launch --nproc-per-node 2 -- python -m jaxdp.bench collectives --reduce-scatter --devices 2
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any, Callable

from jaxdp.bench.report import human, parse_size, print_table, write_json
from jaxdp.bench.timing import interleaved, paired_ratio

DEFAULT_SIZES = "1KB,64KB,1MB,16MB,64MB"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("collectives", help="all-reduce time, algbw and busbw per strategy and size")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--sizes", type=lambda t: [parse_size(v) for v in t.split(",")],
                   default=[parse_size(v) for v in DEFAULT_SIZES.split(",")], help="bytes per device, e.g. 1KB,64MB")
    p.add_argument("--strategies", type=lambda t: t.split(","), default=None,
                   help="default: all of jaxdp.registry.STRATEGIES")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--ring-floor", action="store_true", help="also time a diagnostic: only the ring's 2(N-1) ppermute hops")
    p.add_argument("--reduce-scatter", action="store_true",
                   help="time reduce-scatters instead: XLA's psum_scatter, psum + slice, the ring's (several processes too)")
    p.add_argument("--json", help="write {'results': [...], 'machine': {...}} here")
    p.add_argument("--plot", help="write a PNG of busbw vs size here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> list[dict]:
    if args.reduce_scatter:
        return run_reduce_scatter(args)
    import jax
    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jaxdp.mesh import DATA_AXIS, make_mesh, replicate, shard_batch
    from jaxdp.registry import STRATEGIES
    from jaxdp.sync.collectives import is_on_host

    if len(jax.devices()) < args.devices:
        raise SystemExit(f"jaxdp.bench: asked for {args.devices} devices, JAX has {len(jax.devices())}")
    mesh = make_mesh(jax.devices()[:args.devices])
    n = mesh.size
    strategies = list(args.strategies or STRATEGIES)

    def in_graph(strategy: Callable) -> Callable:
        body = lambda x: strategy({"grad": x[0]}, DATA_AXIS)["grad"][None]  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS), check_vma=False))

    def on_host(strategy: Callable) -> Callable:
        def call(x):  # the whole path: every device -> host, numpy mean, host -> every device
            shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start)
            local = jax.device_get([s.data for s in shards])
            return replicate(strategy([{"grad": a[0]} for a in local], num_devices=n), mesh)
        return call

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
            fn = on_host(registry[name]) if is_on_host(registry[name]) else in_graph(registry[name])
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
        plot(results, args.plot, n)
    return results


def run_reduce_scatter(args: argparse.Namespace) -> list[dict]:
    """--reduce-scatter: one process, or each process of a jax.distributed run (jaxdp.launch)."""
    from jaxdp.cluster import distributed
    from jaxdp.config import Config

    distributed.initialize(Config(devices=args.devices, progress=False))
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jaxdp.mesh import DATA_AXIS, make_mesh, shard_batch
    from jaxdp.sync.collectives import ring_reduce_scatter

    mesh = make_mesh(distributed.mesh_devices(args.devices))
    n, local = mesh.size, len(mesh.local_devices)
    ways = {"psum_scatter": lambda x: jax.lax.psum_scatter(x, DATA_AXIS, tiled=True),
            "psum+slice": lambda x: jax.lax.dynamic_slice_in_dim(jax.lax.psum(x, DATA_AXIS),
                                                                 jax.lax.axis_index(DATA_AXIS) * (x.shape[0] // n), x.shape[0] // n),
            "ring": lambda x: ring_reduce_scatter(x, DATA_AXIS)}
    programs = {name: jax.jit(jax.shard_map(lambda x, fn=fn: fn(x[0])[None], mesh=mesh, in_specs=P(DATA_AXIS),
                                            out_specs=P(DATA_AXIS), check_vma=False)) for name, fn in ways.items()}
    results = []
    for nbytes in args.sizes:
        values = max(n, nbytes // 4 // n * n)
        x = shard_batch(np.random.default_rng(0).standard_normal((local, values), dtype=np.float32), mesh)
        times = interleaved({name: lambda fn=fn, x=x: jax.block_until_ready(fn(x))
                             for name, fn in programs.items()},
                            args.repeats)
        for name in ways:
            median = statistics.median(times[name])
            results.append({"way": name, "devices": n, "processes": jax.process_count(), "bytes": values * 4,
                            "size": human(values * 4), "chunk": human(values * 4 // n), "median_s": median,
                            "min_s": min(times[name]), "repeats": args.repeats,
                            "vs_psum_scatter": paired_ratio(times[name], times["psum_scatter"])})
        del x
    if jax.process_index() == 0:
        print(f"reduce-scatter (sum) of a float32 buffer per device, {n} {jax.default_backend()} devices in "
              f"{jax.process_count()} process(es), median of {args.repeats}")
        print_table(results, [("way", "way", "s"), ("size", "size", "s"), ("chunk", "chunk", "s"),
                              ("median_s", "time ms", ".3f"), ("vs_psum_scatter", "x psum_scatter time", ".2f")])
        write_json(args.json, results)
    return results


def plot(results: list[dict], path: str, n: int) -> None:
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
