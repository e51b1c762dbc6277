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


def muon(lr: Any, momentum: float, weight_decay: float, *, muon_lr: Any = None, on: str = "all"
         ) -> optax.GradientTransformation:
    """Muon (optax.contrib.muon's update and state, its Newton-Schulz batched by matrix shape:
    jaxdp/step/muon.py): momentum orthogonalised by Newton-Schulz for weight matrices, Adam (its
    usual fallback, at `lr`) for every other leaf. `muon_lr`: the matrices' learning rate (None:
    `lr`). `on`: which leaves are Muon's: "hidden" (`hidden_matrices`: the hidden layers' kernels,
    the GPT's attention kernels as matrices too; embeddings, the head, biases and norms Adam's, as
    Muon's authors and MuLoCo use it) or "all" (optax's default: every 2-D leaf)."""
    from jaxdp.step.muon import muon as batched_muon

    return batched_muon(lr if muon_lr is None else muon_lr, adam_learning_rate=None if muon_lr is None else lr,
                        dimension_numbers=hidden_matrices if on == "hidden" else None)


def hidden_matrices(params: Any) -> Any:
    """Muon's dimension numbers for `on="hidden"`: every 2-D `kernel` (a Dense layer's) but the head's
    (a module named "head"), and jaxdp's GPT's attention kernels, `qkv_i` [d, 3, heads, head_dim]
    (q, k and v each a [d, d] matrix) and `proj_i` [heads, head_dim, d]; None (Adam) elsewhere:
    embeddings, biases, norms, convolutions."""
    from optax.contrib import MuonDimensionNumbers as Dims

    def dims(path: Any, x: Any) -> Any:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        module = keys[-2] if len(keys) > 1 else ""
        if keys[-1] != "kernel" or module == "head":
            return None
        if x.ndim == 2:
            return Dims()
        if module.startswith("qkv_") and x.ndim == 4:
            return Dims(reduction_axis=0, output_axis=(2, 3))
        if module.startswith("proj_") and x.ndim == 3:
            return Dims(reduction_axis=(0, 1), output_axis=2)
        return None

    return jax.tree_util.tree_map_with_path(dims, params)


def make_optimizer(name: str, lr: Any, momentum: float = 0.9, weight_decay: float = 1e-4, *,
                   clip_norm: float = 0.0, decay_matrices_only: bool = False, muon_lr: Any = None,
                   muon_on: str = "all") -> optax.GradientTransformation:
    """The optax optimizer called `name` in `jaxdp.registry.OPTIMIZERS`; `lr` may be a schedule.
    `clip_norm` > 0 clips the global gradient norm first (optax.clip_by_global_norm).
    `decay_matrices_only`: adamw's weight decay on parameters of two or more dimensions only
    (`matrices`); the optimizer state has the same arrays either way. `muon_lr`, `muon_on`: muon's
    (`muon`)."""
    from jaxdp.registry import OPTIMIZERS

    if decay_matrices_only and name in OPTIMIZERS and OPTIMIZERS[name] is adamw:
        tx = adamw(lr, momentum, weight_decay, mask=matrices)
    elif name in OPTIMIZERS and OPTIMIZERS[name] is muon:
        tx = muon(lr, momentum, weight_decay, muon_lr=muon_lr, on=muon_on)
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
