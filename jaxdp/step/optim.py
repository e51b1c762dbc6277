"""Optimizers, outer optimizers and learning-rate schedules, by their names in jaxdp.registry.

    tx = make_optimizer("adamw", make_schedule("cosine", 3e-4, steps=1000), weight_decay=0.1, clip_norm=1.0)
    outer = make_outer_optimizer("nesterov", lr=0.7, momentum=0.9)      # local steps (DiLoCo)

Each builder is a small function registered in `OPTIMIZERS`, `OUTER_OPTIMIZERS` or `SCHEDULES`
(jaxdp/registry.py), so the command line's choices, its help and these factories read one list.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

# ---------------------------------------------------------------------------------------------
# The optimizers behind --optimizer (jaxdp.registry.OPTIMIZERS): (lr, momentum, weight_decay) -> tx
# ---------------------------------------------------------------------------------------------


def adam(lr: Any, momentum: float, weight_decay: float) -> optax.GradientTransformation:
    return optax.adam(lr)


def adamw(lr: Any, momentum: float, weight_decay: float, mask: Any = None) -> optax.GradientTransformation:
    return optax.adamw(lr, weight_decay=weight_decay, mask=mask)


def matrices(params: Any) -> Any:
    """True for the parameters weight decay applies to, nanoGPT's rule: two or more dimensions
    (kernels, embeddings), not biases or LayerNorm scales."""
    return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def sgd(lr: Any, momentum: float, weight_decay: float) -> optax.GradientTransformation:
    return optax.sgd(lr)


def momentum(lr: Any, momentum: float, weight_decay: float) -> optax.GradientTransformation:
    return optax.sgd(lr, momentum=momentum)


def muon(lr: Any, momentum: float, weight_decay: float) -> optax.GradientTransformation:
    """Muon (optax.contrib.muon): momentum orthogonalised by Newton-Schulz for the 2-D weight
    matrices, Adam (its usual fallback, the same lr) for every other leaf (biases, norms, 3-D kernels)."""
    from optax import contrib

    return contrib.muon(lr)


def make_optimizer(name: str, lr: Any, momentum: float = 0.9, weight_decay: float = 1e-4, *,
                   clip_norm: float = 0.0, decay_matrices_only: bool = False) -> optax.GradientTransformation:
    """The optax optimizer called `name` in `jaxdp.registry.OPTIMIZERS`; `lr` may be a schedule.
    `clip_norm` > 0 clips the global gradient norm first (optax.clip_by_global_norm).
    `decay_matrices_only`: adamw's weight decay on parameters of two or more dimensions only
    (`matrices`); the optimizer state has the same arrays either way."""
    from jaxdp.registry import OPTIMIZERS

    if decay_matrices_only and name in OPTIMIZERS and OPTIMIZERS[name] is adamw:
        tx = adamw(lr, momentum, weight_decay, mask=matrices)
    else:
        tx = OPTIMIZERS[name](lr, momentum, weight_decay)
    return optax.chain(optax.clip_by_global_norm(clip_norm), tx) if clip_norm else tx


# The outer optimizers behind --outer-optimizer (jaxdp.registry.OUTER_OPTIMIZERS; local steps,
# jaxdp/step/local_sgd.py): (lr, momentum) -> tx, applied to the averaged pseudo-gradient every sync.


def nesterov_outer(lr: float, momentum: float) -> optax.GradientTransformation:
    if not momentum:
        raise ValueError("the nesterov outer optimizer needs a momentum > 0; use sgd for none")
    return optax.sgd(lr, momentum=momentum, nesterov=True)


def sgd_outer(lr: float, momentum: float) -> optax.GradientTransformation:
    return optax.sgd(lr, momentum=momentum or None)


def make_outer_optimizer(name: str, lr: float, momentum: float) -> optax.GradientTransformation:
    """The optimizer that applies the averaged pseudo-gradient to the global parameters every sync,
    by its name in `jaxdp.registry.OUTER_OPTIMIZERS`: "nesterov" (DiLoCo: lr 0.7, momentum 0.9) or
    "sgd" (heavy-ball momentum if `momentum` > 0; lr 1 and momentum 0 is plain model averaging,
    Local SGD)."""
    from jaxdp.registry import OUTER_OPTIMIZERS

    return OUTER_OPTIMIZERS[name](lr, momentum)


# ---------------------------------------------------------------------------------------------
# The schedules behind --schedule (jaxdp.registry.SCHEDULES): (lr, steps, warmup, final) -> schedule
# ---------------------------------------------------------------------------------------------


def constant_schedule(lr: float, steps: int, warmup_steps: int, final_fraction: float) -> optax.Schedule:
    del steps, final_fraction
    if warmup_steps:
        return optax.linear_schedule(0.0, lr, warmup_steps)
    return optax.constant_schedule(lr)


def cosine_schedule(lr: float, steps: int, warmup_steps: int, final_fraction: float) -> optax.Schedule:
    del warmup_steps
    return optax.cosine_decay_schedule(lr, max(steps, 1), alpha=final_fraction)


def warmup_cosine_schedule(lr: float, steps: int, warmup_steps: int, final_fraction: float) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, max(steps, warmup_steps + 1),
                                              end_value=lr * final_fraction)


def make_schedule(name: str, lr: float, steps: int, warmup_steps: int = 0, final_fraction: float = 0.1) -> optax.Schedule:
    """The learning rate as a function of the step, by its name in `jaxdp.registry.SCHEDULES`."""
    from jaxdp.registry import SCHEDULES

    return SCHEDULES[name](lr, steps, warmup_steps, final_fraction)
