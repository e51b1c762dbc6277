"""One process of a 2-process CPU run that times an all-reduce with the controller's probe loop,
process 1 starting its timed runs 0.2 s after process 0 (a slow warm-up), then prints how many
times it ran the all-reduce and the value every process takes for the guard's error. Every process
must run the all-reduce as often as the others, or one waits in an all-reduce that the other never
joins."""

import sys
import time

from jaxdp.cluster import distributed
from jaxdp.config import Config

process_id, address = int(sys.argv[1]), sys.argv[2]
distributed.initialize(Config(devices=1, progress=False, coordinator_address=address, num_processes=2,
                              process_id=process_id))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jaxdp.sync.controller import _fastest_time, _over_processes  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("d",))
total = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), np.ones((8,), np.float32))
calls = 0


def probe():
    global calls
    calls += 1
    out = jax.block_until_ready(total(x))
    if calls == 1 and process_id == 1:
        time.sleep(0.2)  # process 0's first timed all-reduce waits for this; its budget runs out first
    return out


_fastest_time(probe, repeats=3)
largest = float(_over_processes(np.float32(0.25 + process_id), np.max))  # as the guard's errors: one for all
print(f"calls={calls} largest={largest}", flush=True)
