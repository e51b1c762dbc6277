"""One process of tests/test_live_devices.py: a sum over JAX's `live_devices` every 0.2 s, one line each.

    python tests/live_devices_worker.py COORDINATOR PROCESS_ID NUM_PROCESSES
"""

import sys
import time

import jax

jax.config.update("jax_enable_recoverability", True)  # before initialize (docs: "Fault Tolerant Distributed JAX")
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 1)
address, process, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
jax.distributed.initialize(address, num_processes=count, process_id=process, heartbeat_timeout_seconds=5)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.multihost_utils import live_devices  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    try:
        with live_devices(jax.devices()) as devices:
            mesh = Mesh(np.array(devices), ("d",))
            sharding = NamedSharding(mesh, P("d"))
            local = [jax.device_put(jnp.ones(1), d) for d in devices if d.process_index == jax.process_index()]
            x = jax.make_array_from_single_device_arrays((len(devices),), sharding, local)
            total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
            print(f"live {len(devices)} sum {float(total.addressable_data(0)[()]):g}", flush=True)
    except Exception as err:  # a process died during the block: every live process gets here
        print(f"failed {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}", flush=True)
    time.sleep(0.2)
