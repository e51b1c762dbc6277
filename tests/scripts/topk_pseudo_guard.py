"""The figures behind jaxdp.sync.costmodel.PSEUDO_GUARD_THRESHOLD: the quality guard's replay error
(the controller's own `truth` and `replay`: GUARD_WINDOW batches' mean gradients, error feedback and
its decay threaded) of the top-k pseudo-gradient codecs `--sync-every auto --compression auto` may
choose (2-bit values, all-gathered, error feedback decayed by 0.98), at the first step, on
`python -m jaxdp.bench localsgd`'s GPT (2 layers x 64, 4 heads, batch 16 of 64 tokens, Adam 3e-3;
the corpus's bytes as tokens). The held-out losses those codecs reach are the bench's own runs
(docs/slow-links.md). 2 simulated CPU devices; not a test (about a minute on 2 cores).

    python tests/scripts/topk_pseudo_guard.py CORPUS
"""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp.models.builtin import GPT  # noqa: E402
from jaxdp.models.tasks import token_cross_entropy  # noqa: E402
from jaxdp.sync import codecs, costmodel  # noqa: E402
from jaxdp.sync.controller import GUARD_BATCHES, Controller  # noqa: E402

SEQ, BATCH = 64, 16
mesh = jaxdp.make_mesh(jax.devices()[:2])
tokens = np.frombuffer(open(sys.argv[1], "rb").read(), np.uint8).astype(np.int32)
model = GPT(vocab_size=256, seq_len=SEQ, layers=2, d_model=64, heads=4)
params0 = model.init(jax.random.PRNGKey(0), np.zeros((1, SEQ), np.int32))["params"]
tx = optax.adam(3e-3)


def loss_fn(params, batch):
    return token_cross_entropy(model.apply({"params": params}, batch["x"]), batch["y"]).mean()


rng = np.random.default_rng(0)


def batch():
    start = rng.integers(0, len(tokens) - SEQ - 1, BATCH)
    w = np.stack([tokens[i:i + SEQ + 1] for i in start])
    return jaxdp.shard_batch({"x": w[:, :-1], "y": w[:, 1:]}, mesh)


step = jaxdp.make_train_step(loss_fn, tx, mesh, "ring")
controller = Controller(step.local_grads, mesh, step.strategy, params0)
state = jaxdp.init_state(params0, tx, mesh, compression="auto")
print(f"{'codec':>32} {'error at 0':>10}   (threshold {costmodel.PSEUDO_GUARD_THRESHOLD})")
for seed in range(3):
    truth = controller.truth(state, [batch() for _ in range(GUARD_BATCHES)])
    for c in [*controller.pseudo_topk, *(codecs.parse(f"topk:{d}:2:gather:decay=0.98") for d in (0.0005, 0.0002))]:
        print(f"{c.name:>32} {controller.replay(c, truth):>10.4f}  window {seed}", flush=True)
