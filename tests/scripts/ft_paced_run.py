"""One worker of an elastic run on torchft (`jaxdp.launch --elastic --elastic-engine torchft
--nproc-per-node 2 -- python ft_paced_run.py OUT`) of `jaxdp.fit(..., sync_seconds=SCHEDULE)`: the two
ranks take different numbers of inner steps per round (rank 1 none in round 1). The lead saves the final
parameters (OUT, .npy); every worker prints its step and the positions table.

    ft_paced_run.py OUT STEPS CKPT: rank 0 takes 4 steps a round and rank 1 one, to STEPS, with
    checkpoints in CKPT every 5 steps (the same command with a smaller STEPS resumes from them)."""

import sys

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from helpers import mlp_batches, mlp_problem  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp import elastic  # noqa: E402
from jaxdp.mesh import Mesh, DATA_AXIS  # noqa: E402
from jaxdp.elastic.timed import positions_of  # noqa: E402

SCHEDULE = [[3, 1], [2, 0], [1, 4]]  # steps by [round][rank] (rank 0's 1 in round 3 would pass steps=5)
member = elastic.from_env()
params, loss_fn = mlp_problem()
batches = list(mlp_batches(24, batch=64))
steps, pace, checkpoint = 5, (lambda r, rank: SCHEDULE[r][rank]), jaxdp.CheckpointOptions()
if len(sys.argv) > 2:
    steps, pace = int(sys.argv[2]), (lambda r, rank: 4 if rank == 0 else 1)
    checkpoint = jaxdp.CheckpointOptions(directory=sys.argv[3], save_every=5, keep=10)
result = jaxdp.fit(loss_fn, params, optax.sgd(0.1, momentum=0.9),
                   lambda k, shard: jax.tree.map(lambda x: x[32 * shard: 32 * (shard + 1)], batches[k]), steps=steps,
                   mesh=Mesh(np.array(jax.local_devices()), (DATA_AXIS,)),
                   sync=jaxdp.SyncOptions(strategy="ring", sync_seconds=pace), checkpoint=checkpoint,
                   logging=jaxdp.LogOptions(progress=False), run=jaxdp.RunOptions(elastic=member))
if member.lead:
    np.save(sys.argv[1], np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(result.state.params)]))
print(f"step={int(result.state.step)} positions={','.join(map(str, positions_of(result.state)))}", flush=True)
