"""Bring your own Flax model, optax optimizer and numpy data: data-parallel training in one file.

    python examples/custom_model.py                      # 8 simulated CPU devices, ring all-reduce
    python examples/custom_model.py --strategy psum --steps 300 --devices 4

Everything here is user code except the four jaxdp calls marked `# jaxdp`. The model uses dropout,
so the loss function takes the stateful form, `loss_fn(params, model_state, batch, rng)`: `rng`
differs per device and per step, and `model_state` (empty here; BatchNorm statistics in a model
that has them) is averaged over devices after every step.
"""

from __future__ import annotations

import argparse
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ring", help="psum, ring or host (default: ring)")
    parser.add_argument("--steps", type=int, default=400, help="training steps (default: 400)")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size (default: 256)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices when no accelerator is present (default: 8)")
    return parser.parse_args()


args = parse_args()

import jax  # noqa: E402  (after the flags: the device count must be set before JAX starts)

jax.config.update("jax_num_cpu_devices", args.devices)  # affects the CPU backend only

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402


# ---- data: any numpy arrays -------------------------------------------------------------------
def make_data(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A 4-class problem in 16 dimensions whose classes are separated by a nonlinear boundary."""
    x = rng.standard_normal((n, 16)).astype(np.float32)
    features = np.stack([x[:, 0] * x[:, 1], np.sin(2 * x[:, 2]), x[:, 3] ** 2 - 1, x[:, 4] - x[:, 5]], axis=1)
    return x, np.argmax(features, axis=1).astype(np.int32)


rng = np.random.default_rng(0)
x_train, y_train = make_data(16384, rng)
x_test, y_test = make_data(2048, rng)


# ---- model: any Flax module ---------------------------------------------------------------------
class ResidualMLP(nn.Module):
    width: int = 128
    depth: int = 3
    num_classes: int = 4
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
        x = nn.Dense(self.width)(x)
        for _ in range(self.depth):
            h = nn.Dense(self.width)(nn.gelu(nn.LayerNorm()(x)))
            x = x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)
        return nn.Dense(self.num_classes)(nn.LayerNorm()(x))


model = ResidualMLP()
params = model.init(jax.random.PRNGKey(0), x_train[:1])["params"]

# ---- optimizer: any optax GradientTransformation ------------------------------------------------
schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=args.steps // 10, decay_steps=args.steps)
tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4))


def loss_fn(params, model_state, batch, rng):
    logits = model.apply({"params": params}, batch["x"], train=True, rngs={"dropout": rng})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
    return loss, {"accuracy": accuracy}, model_state


# ---- data-parallel training ---------------------------------------------------------------------
mesh = jaxdp.make_mesh()                                                               # jaxdp
state = jaxdp.init_state(params, tx, mesh, rng=1)                                      # jaxdp
step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy=args.strategy, stateful=True)  # jaxdp
print(f"{mesh.size} devices ({jax.devices()[0].platform}), strategy={args.strategy}, "
      f"global batch {args.batch_size} = {args.batch_size // mesh.size} rows per device")

start = time.perf_counter()
for i in range(args.steps):
    rows = np.random.default_rng([0, i]).choice(len(x_train), args.batch_size, replace=False)
    batch = jaxdp.shard_batch({"x": x_train[rows], "y": y_train[rows]}, mesh)          # jaxdp
    state, metrics = step(state, batch)
    if (i + 1) % 100 == 0 or i + 1 == args.steps:
        print(f"step {i + 1:4d}  loss {float(metrics['loss']):.4f}  "  # float(): a host sync point
              f"train accuracy {float(metrics['accuracy']):.3f}")
elapsed = time.perf_counter() - start

# The parameters are replicated: every device holds the same copy, so evaluate one on the host.
logits = jax.jit(model.apply)({"params": jax.device_get(state.params)}, x_test)
print(f"test accuracy {float(jnp.mean(jnp.argmax(logits, -1) == y_test)):.3f} "
      f"after {args.steps} steps in {elapsed:.1f}s")
