"""One process of a 2-process CPU run that compiles one collective program and one on its own device
with the persistent compilation cache at argv[3], then prints how many programs it loaded from that
cache."""

import sys

from jaxdp.cluster import distributed, runtime
from jaxdp.config import Config

process_id, address, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
distributed.initialize(Config(devices=1, progress=False, coordinator_address=address, num_processes=2,
                              process_id=process_id))
runtime.enable_compile_cache(cache)
hits = runtime.CacheHits()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("d",))
total = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x * (1 + jax.lax.axis_index("d")), "d"), mesh=mesh,
                              in_specs=P("d"), out_specs=P("d")))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), np.full((8,), process_id + 1, np.float32))
value = float(total(x).addressable_shards[0].data[0])
local = jax.jit(lambda a: a * 3 + process_id)(np.ones(4, np.float32))  # on this process's device alone
assert float(local[0]) == 3 + process_id
print(f"hits={hits.hits} value={value}", flush=True)
