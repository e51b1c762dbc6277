"""The figures behind jaxdp.sync.costmodel.GUARD_THRESHOLD: PowerSGD's running-sum error per window of
100 steps, its error_ratio, and the held-out accuracy, on the CLI's MLP / digits, 8 simulated CPU
devices, SGD momentum. Not a test (about 100 s on 2 cores):

    python tests/scripts/compression_guard_window.py
"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits
from jaxdp.mesh import make_mesh, shard_batch, replicate
from jaxdp.models.builtin import MLP
from jaxdp.sync import codecs as C, costmodel

N, STEPS, W, B = 8, 600, 100, 256
x, y = load_digits(return_X_y=True)
x = x.astype(np.float32) / 16
xt, yt, xv, yv = x[:1500], y[:1500], x[1500:], y[1500:]
mesh = make_mesh(jax.devices()[:N])
model = MLP()
params0 = model.init(jax.random.PRNGKey(0), xt[:1])["params"]
tx = optax.sgd(0.1, momentum=0.9)


def running_sum_error(applied_sum, mean_error_start, mean_error_end):
    """relative_error of a window's summed applied means against its summed true means, from the
    devices' mean error at each end: error feedback telescopes, sum of true = sum of applied + e_end - e_start."""
    true_sum = jax.tree.map(lambda a, e1, e0: a + e1 - e0, applied_sum, mean_error_end, mean_error_start)
    return costmodel.relative_error(applied_sum, true_sum)

def loss_fn(p, b):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, b["x"]), b["y"]).mean()

for spec in ["none", "powersgd:8", "powersgd:4", "powersgd:2", "powersgd:1"]:
    comp = C.parse(spec)
    def body(params, opt, err, q, batch, step):
        g = jax.grad(loss_fn)(params, batch)
        mean, st, sc = comp.mean(g, C.CompressionState(jax.tree.map(lambda e: e[0], err), q),
                                 lambda t: jax.lax.psum(t, "data"), N, step)
        upd, opt = tx.update(mean, opt, params)
        return optax.apply_updates(params, upd), opt, jax.tree.map(lambda e: e[None], st.error), st.q, mean, sc
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data"), P(), P("data"), P()),
                              out_specs=(P(), P(), P("data"), P(), P(), P()), check_vma=False))
    st0 = comp.init(params0)
    params, opt = replicate(params0, mesh), replicate(tx.init(params0), mesh)
    err = shard_batch(jax.tree.map(lambda e: np.zeros((N, *e.shape), np.float32), st0.error), mesh)
    q = replicate(st0.q, mesh)
    rng = np.random.default_rng(0)
    def flat(t):
        return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(t)[0]}
    e_start, applied, errs, ratios = None, None, [], []
    for s in range(STEPS):
        idx = rng.integers(0, len(xt), B)
        params, opt, err, q, mean, sc = f(params, opt, err, q, shard_batch({"x": xt[idx], "y": yt[idx]}, mesh), jnp.int32(s))
        mean = flat(jax.device_get(mean))
        if s % W == 0:
            e_host = jax.device_get(err)
            e_start = {k: (e_host[k].mean(0) if k in e_host else np.zeros_like(v)) for k, v in mean.items()}
            applied = jax.tree.map(np.zeros_like, mean)
        applied = jax.tree.map(np.add, applied, mean)
        if s % W == W - 1:
            e_host = jax.device_get(err)
            e_end = {k: (e_host[k].mean(0) if k in e_host else np.zeros_like(v)) for k, v in mean.items()}
            errs.append(float(running_sum_error(applied, e_start, e_end)))
            if sc:
                ratios.append(float(sc["error_ratio"]))
    acc = float((model.apply({"params": jax.device_get(params)}, xv).argmax(-1) == yv).mean())
    print(f"{spec:12s} payload {comp.payload_bytes(params0):>8d} B ({comp.payload_bytes(params0)/C.uncompressed_bytes(params0):.3f}x)"
          f"  held-out acc {acc:.3f}  window({W}) running-sum error {' '.join(f'{e:.3f}' for e in errs)}"
          + (f"  error_ratio {' '.join(f'{r:.2f}' for r in ratios)}" if ratios else ""), flush=True)
