"""A user's own multi-process script: jax.distributed.initialize by hand, then only the notebook API.

    python tests/scripts/notebook_api_run.py OUT.json STRATEGY,... COORDINATOR NUM_PROCESSES PROCESS_ID DEVICES

Trains a small MLP for a few steps with each strategy on the same global batches and writes the
per-step losses (process 0) to OUT.json. With NUM_PROCESSES 1 no coordinator is started.
"""

import json
import sys

out, strategies, coordinator, num_processes, process_id, devices = sys.argv[1:7]
num_processes, process_id, devices = int(num_processes), int(process_id), int(devices)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", devices)
if num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)

import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp.models.builtin import MLP  # noqa: E402

STEPS, BATCH = 4, 32
rng = np.random.default_rng(0)
batches = [{"x": rng.standard_normal((BATCH, 12), dtype=np.float32), "y": rng.integers(0, 5, BATCH)}
           for _ in range(STEPS)]
mine = slice(process_id * BATCH // num_processes, (process_id + 1) * BATCH // num_processes)

model = MLP(hidden=(16,), num_classes=5)
params = model.init(jax.random.PRNGKey(0), batches[0]["x"][:1])["params"]


def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


mesh = jaxdp.make_mesh()
losses = {}
for strategy in strategies.split(","):
    tx = optax.sgd(0.5)
    state = jaxdp.init_state(params, tx, mesh)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy=strategy)
    losses[strategy] = []
    for batch in batches:
        state, metrics = step(state, jaxdp.shard_batch({k: v[mine] for k, v in batch.items()}, mesh))
        losses[strategy].append(float(metrics["loss"]))
    losses[strategy].append(float(np.asarray(jax.device_get(state.params["Dense_0"]["kernel"])).sum()))
if process_id == 0:
    with open(out, "w") as f:
        json.dump(losses, f)
