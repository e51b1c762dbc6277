"""The train state (an immutable pytree, replicated over the mesh) and optimizer construction."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxdp.mesh import replicate, replicated


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes; update it with `.replace(...)`.

    step:        int32 scalar, number of updates applied so far.
    params:      the model parameters.
    opt_state:   the optax state for `params`.
    model_state: mutable model collections (e.g. {"batch_stats": ...}); {} when the model has none.
    rng:         a raw uint32[2] PRNG key; the step derives per-step, per-device keys from it and
                 `step`, so it never changes and a resumed run draws the same numbers.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = flax.struct.field(default_factory=dict)
    rng: jax.Array | None = None


def init_state(params: Any, tx: optax.GradientTransformation, mesh: Mesh, *,
               model_state: Any = None, rng: Any = 0) -> TrainState:
    """A TrainState with `params` (and `model_state`) replicated over `mesh` and a fresh `tx` state.

    `params` may be host or device values; in a multi-process run every process must pass the
    same values (initialise from the same seed). `rng` is an int seed or a PRNG key.
    """
    if isinstance(rng, (int, np.integer)):
        rng = jax.random.PRNGKey(int(rng))
    elif jnp.issubdtype(jnp.result_type(rng), jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    params = replicate(params, mesh)
    opt_state = jax.jit(tx.init, out_shardings=replicated(mesh))(params)
    return TrainState(
        step=replicate(np.int32(0), mesh),
        params=params,
        opt_state=opt_state,
        model_state=replicate({} if model_state is None else model_state, mesh),
        rng=replicate(np.asarray(rng, dtype=np.uint32), mesh),
    )


def make_optimizer(name: str, lr: float, momentum: float = 0.9, weight_decay: float = 1e-4) -> optax.GradientTransformation:
    """The optax optimizer behind `--optimizer`."""
    if name == "adam":
        return optax.adam(lr)
    if name == "adamw":
        return optax.adamw(lr, weight_decay=weight_decay)
    if name == "sgd":
        return optax.sgd(lr)
    if name == "momentum":
        return optax.sgd(lr, momentum=momentum)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


OPTIMIZERS = ("adam", "adamw", "sgd", "momentum")
