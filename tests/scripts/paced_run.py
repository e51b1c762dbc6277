"""One process of a 2-process CPU run (2 devices each) of `jaxdp.fit(..., sync_seconds=SCHEDULE)`:
process 0 and 1 take different numbers of inner steps per round (process 1 none in round 1).
Prints the final parameters (as a .npy path), the step and each process's recorded position."""

import sys

from jaxdp.cluster import distributed
from jaxdp.config import Config

process_id, address, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
distributed.initialize(Config(devices=2, progress=False, coordinator_address=address, num_processes=2,
                              process_id=process_id))

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from helpers import mlp_batches, mlp_problem  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp.step.rounds import PACE_NAME  # noqa: E402

SCHEDULE = [[3, 1], [2, 0], [1, 4]]  # steps by [round][process]
params, loss_fn = mlp_problem()
batches = list(mlp_batches(12, batch=64))
result = jaxdp.fit(loss_fn, params, optax.sgd(0.1, momentum=0.9), lambda k: jax.tree.map(
    lambda x: x[32 * process_id: 32 * (process_id + 1)], batches[k]), steps=5, strategy="ring",
    sync_seconds=lambda r, p: SCHEDULE[r][p], progress=False)
flat = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(result.state.params)])
if process_id == 0:
    np.save(out, flat)
position = result.state.sync.per_device[PACE_NAME]["position"]
mine = int(np.asarray(position.addressable_shards[0].data)[0])
print(f"step={int(result.state.step)} position={mine}", flush=True)
