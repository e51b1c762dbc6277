"""One process of a 2-process x 2-device CPU run (jax.distributed over gloo) that runs jaxdp's
reduce-scatters on large chunks with fresh random inputs, CALLS times each, and counts the values
that differ from a numpy reference (the mean over devices of each device's chunk):

    python tests/scripts/reduce_scatter_check.py PROCESS_ID COORDINATOR CHUNK_MIB CALLS [CASE,...]

- psum:       `PSUM.halves.reduce_scatter` on the flat mesh (ZeRO-1 over psum);
- hier:       `hierarchical("psum").halves.reduce_scatter` on the (hosts, local) mesh (ZeRO-1 with
              --hierarchy auto);
- hier_mean:  `hierarchical("psum")` itself, the all-reduce of --hierarchy auto (a reduce-scatter
              inside each process, the strategy across, an all-gather).

Inputs are multiples of 1/64 below 32 in magnitude, so every sum and mean over 4 devices is exact
in float32 in any order: the outputs must equal the reference bit for bit. The last line of output
is `key=value ...`: the number of wrong values and of calls with any, per case, and how many
reduce-scatter ops (XLA's, which gloo runs) each compiled program holds.
"""

import sys

from jaxdp.cluster import distributed
from jaxdp.config import Config

process_id, address, chunk_mib, calls = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
distributed.initialize(Config(devices=2, progress=False, coordinator_address=address, num_processes=2,
                              process_id=process_id))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxdp.mesh import DATA_AXIS, make_mesh  # noqa: E402
from jaxdp.sync.collectives import PSUM  # noqa: E402
from jaxdp.sync.hierarchy import hierarchical  # noqa: E402

n = jax.device_count()
chunk = int(chunk_mib * 2 ** 20) // 4  # float32 values per device's chunk
flat, two = make_mesh(), make_mesh(axis_name=("hosts", "local"))
hier = hierarchical("psum")
every = {  # name: (mesh, axes, per-device function of its 1-D buffer, whether it keeps only its chunk)
    "psum": (flat, DATA_AXIS, lambda x: PSUM.halves.reduce_scatter(x, DATA_AXIS), True),
    "hier": (two, ("hosts", "local"), lambda x: hier.halves.reduce_scatter(x, ("hosts", "local")), True),
    "hier_mean": (two, ("hosts", "local"), lambda x: hier({"g": x}, ("hosts", "local"))["g"], False),
}
cases = {name: every[name] for name in (sys.argv[5].split(",") if len(sys.argv) > 5 else every)}
programs = {name: jax.jit(jax.shard_map(lambda x, fn=fn: fn(x[0])[None], mesh=mesh, in_specs=P(axes),
                                        out_specs=P(axes), check_vma=False))
            for name, (mesh, axes, fn, _) in cases.items()}

# XLA's reduce-scatter op (which gloo runs) must be in no program jaxdp emits here: a deterministic
# check, where the wrong values come only now and then
in_hlo = {name: programs[name].lower(jax.ShapeDtypeStruct((n, n * chunk), np.float32, sharding=NamedSharding(
    mesh, P(axes)))).as_text(dialect="hlo").count("reduce-scatter(") for name, (mesh, axes, _, _) in cases.items()}

wrong = {name: 0 for name in cases}
wrong_calls = {name: 0 for name in cases}
for call in range(calls):
    rng = np.random.default_rng(call)  # the same global input on both processes
    x = (rng.integers(-2 ** 11, 2 ** 11, (n, n * chunk), dtype=np.int32) / np.float32(64)).astype(np.float32)
    mean = x.mean(0, dtype=np.float64).astype(np.float32)  # exact: every partial sum is exact
    for name, (mesh, axes, _, scatter) in cases.items():
        array = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P(axes)), lambda index: x[index])
        bad = 0
        for shard in programs[name](array).addressable_shards:
            device = shard.index[0].start  # the device's place in the mesh, as rows of x
            want = mean[device * chunk:(device + 1) * chunk] if scatter else mean
            bad += int(np.count_nonzero(np.asarray(shard.data)[0] != want))
        wrong[name] += bad
        wrong_calls[name] += bad > 0
        del array
print(" ".join([f"{k}={v}" for k, v in wrong.items()] + [f"{k}_calls={v}" for k, v in wrong_calls.items()]
               + [f"{k}_hlo={v}" for k, v in in_hlo.items()] + [f"calls={calls}", f"chunk_mib={chunk_mib}"]),
      flush=True)
