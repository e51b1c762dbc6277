"""The figures behind jaxdp.sync.costmodel.GUARD_THRESHOLD for top-k: the quality guard's replay error
(the controller's own `truth` and `replay`: GUARD_WINDOW batches, error feedback threaded) of top-k at
each density of the auto ladder and of PowerSGD's ranks, at the first step and after 100 plain steps,
beside the held-out accuracy each codec reaches training with it from the start. The CLI's MLP on
digits, 2 simulated CPU devices, SGD momentum 0.9, lr 0.1, batch 128. Not a test (about 2 minutes on
2 cores). With --gpt: bench compression's GPT (4 layers x 256, its generated text as bytes, SGD
momentum 0.9, lr 0.3, clipped at 1.0, batch 16 of 64 tokens), 200 steps, held-out loss:

    python tests/scripts/topk_guard_window.py [--gpt]
"""
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp.models.builtin import MLP  # noqa: E402
from jaxdp.sync import codecs  # noqa: E402
from jaxdp.sync.controller import GUARD_BATCHES, Controller  # noqa: E402

GPT = "--gpt" in sys.argv
mesh = jaxdp.make_mesh(jax.devices()[:2])
if GPT:  # bench compression's GPT and its text (jaxdp/bench/compression.py), bytes as tokens
    from jaxdp.bench.compression import write_corpus
    from jaxdp.models.builtin import GPT as Model
    from jaxdp.models.tasks import token_cross_entropy

    STEPS, PROBE_AT, BATCH, SEQ = 200, 100, 16, 64
    with tempfile.TemporaryDirectory() as d:
        text = np.frombuffer(write_corpus(Path(d) / "corpus.txt").read_bytes(), np.uint8).astype(np.int32)
    xt, xv = text[: len(text) * 9 // 10], text[len(text) * 9 // 10:]
    model = Model(vocab_size=256, seq_len=SEQ, layers=4, d_model=256, heads=4)
    params0 = model.init(jax.random.PRNGKey(0), np.zeros((1, SEQ), np.int32))["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.3, momentum=0.9))

    def loss_fn(params, batch):
        return token_cross_entropy(model.apply({"params": params}, batch["x"]), batch["y"]).mean()

    def windows(tokens, rng, count):
        start = rng.integers(0, len(tokens) - SEQ - 1, count)
        w = np.stack([tokens[i:i + SEQ + 1] for i in start])
        return {"x": w[:, :-1], "y": w[:, 1:]}

    def batches(seed):
        rng = np.random.default_rng(seed)
        while True:
            yield jaxdp.shard_batch(windows(xt, rng, BATCH), mesh)

    def quality(params):  # held-out loss, 64 windows
        return float(loss_fn(params, windows(xv, np.random.default_rng(123), 64)))
else:
    STEPS, PROBE_AT, BATCH = 600, 100, 128
    x, y = load_digits(return_X_y=True)
    x, y = x.astype(np.float32) / 16, y.astype(np.int32)
    xt, yt, xv, yv = x[:1500], y[:1500], x[1500:], y[1500:]
    model = MLP()
    params0 = model.init(jax.random.PRNGKey(0), xt[:1])["params"]
    tx = optax.sgd(0.1, momentum=0.9)

    def loss_fn(params, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": params}, batch["x"]),
                                                               batch["y"]).mean()

    def batches(seed):
        rng = np.random.default_rng(seed)
        while True:
            idx = rng.integers(0, len(xt), BATCH)
            yield jaxdp.shard_batch({"x": xt[idx], "y": yt[idx]}, mesh)

    def quality(params):  # held-out accuracy
        return float(np.mean(np.argmax(model.apply({"params": params}, xv), -1) == yv))


step = jaxdp.make_train_step(loss_fn, tx, mesh, "ring")
controller = Controller(step.local_grads, mesh, step.strategy, params0)
specs = ["powersgd:8", "powersgd:4", "powersgd:2", "powersgd:1", "topk:0.1", "topk:0.03", "topk:0.01", "topk:0.003",
         "topk:0.001"]
candidates = [codecs.parse(s).settled(params0, 2, False) for s in specs]
state, data = jaxdp.init_state(params0, tx, mesh, compression="auto"), batches(0)
errors = {}
for at in (0, PROBE_AT):
    while int(state.step) < at:
        state, _ = step(state, next(data))
    probe = batches(at + 1)
    truth = controller.truth(state, [next(probe) for _ in range(GUARD_BATCHES)])
    for c in candidates:
        errors.setdefault(c.name, []).append(controller.replay(c, truth))
print(f"{'codec':>20} {'error at 0':>10} {'at ' + str(PROBE_AT):>10} {'loss' if GPT else 'accuracy':>9}")
for spec, c in zip(["none", *specs], [None, *candidates]):
    run = jaxdp.make_train_step(loss_fn, tx, mesh, "ring", compression=c)
    state, data = jaxdp.init_state(params0, tx, mesh, compression=c), batches(0)
    for _ in range(STEPS):
        state, _ = run(state, next(data))
    e = errors.get(c.name, [0.0, 0.0]) if c else [0.0, 0.0]
    print(f"{c.name if c else 'none':>20} {e[0]:>10.3f} {e[1]:>10.3f} {quality(jax.device_get(state.params)):>9.4f}",
          flush=True)
