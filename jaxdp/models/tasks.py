"""What the built-in models are trained to do: the loss, and the held-out metrics.

A `Task` holds the three functions the trainer needs for a Flax module:

* `loss_fn(params, model_state, batch, rng) -> (loss, aux, new_model_state)`, the stateful form of
  `make_train_step` (BatchNorm statistics, dropout);
* `eval_fn(params, model_state, batch) -> sums`, per-device sums that `make_eval_step` adds over
  devices (padding rows carry `mask` 0);
* `summarize(totals) -> {"eval_loss": ..., ...}`, the held-out metrics from the summed totals.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxdp.models import kernels


@dataclasses.dataclass(frozen=True)
class Task:
    loss_fn: Callable
    eval_fn: Callable
    summarize: Callable[[dict[str, float]], dict[str, float]]


def token_cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
    """Softmax cross-entropy of integer `labels` (...,) under `logits` (..., V) of any float dtype,
    in float32: `optax.softmax_cross_entropy_with_integer_labels(logits.astype(float32), labels)`,
    the same arithmetic, without a float32 copy of the logits in memory.

    For a GPT's bf16 logits that copy was the largest tensor of a step (tokens x vocabulary x 4 bytes:
    3.3 GB for GPT-2 small at batch 16) and writing it, reading it twice and reading it again for the
    gradient took a share of an H100/H200 step worth saving (docs/performance.md, "GPUs: GPT-2
    small on one H200"). Here the maximum is taken in the logits' own dtype (exact), each pass
    upcasts as it reads, and the gradient, softmax minus the one-hot labels, is computed from the
    logits kept as they came and written in their dtype, in the order optax's own gradient takes
    (the same bits).
    float32 logits go to optax's function itself (nothing to save; the same bits as before).
    """
    if logits.dtype == jnp.float32:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return _low_precision_cross_entropy(logits, labels)


@jax.custom_vjp
def _low_precision_cross_entropy(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
    return _cross_entropy_fwd(logits, labels)[0]


def _cross_entropy_fwd(logits, labels):
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    shifted = logits.astype(jnp.float32) - top.astype(jnp.float32)
    total = jnp.sum(jnp.exp(shifted), axis=-1)
    label_logit = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0].astype(jnp.float32)
    return jnp.log(total) - (label_logit - top[..., 0].astype(jnp.float32)), (logits, labels, top, total)


def _cross_entropy_bwd(residuals, g):
    logits, labels, top, total = residuals
    # The barrier keeps XLA from merging this upcast with the forward's into one stored float32 copy.
    logits = jax.lax.optimization_barrier(logits)
    shifted = logits.astype(jnp.float32) - top.astype(jnp.float32)
    # In the order reverse-mode differentiation of optax's function takes, so the bits are its bits:
    # exp(shifted) * (g / total), then g taken off at the label.
    grad = jnp.exp(shifted) * (g / total)[..., None]
    one_hot = labels[..., None] == jnp.arange(logits.shape[-1], dtype=labels.dtype)
    return jnp.where(one_hot, grad - g[..., None], grad).astype(logits.dtype), None


_low_precision_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def classification(model: nn.Module, takes_train: bool = True) -> Task:
    """Softmax cross-entropy on integer labels; held-out loss and accuracy. `takes_train`: the
    module's `__call__` has a `train` parameter (the built-in MLP and CNN do)."""
    mode = (lambda train: {"train": train}) if takes_train else (lambda train: {})

    def loss_fn(params, model_state, batch, rng):
        logits, new_model_state = model.apply({"params": params, **model_state}, batch["x"], **mode(True),
                                              rngs={"dropout": rng}, mutable=list(model_state))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return loss, {"accuracy": accuracy}, new_model_state

    def eval_fn(params, model_state, batch):
        logits = model.apply({"params": params, **model_state}, batch["x"], **mode(False))
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        correct = jnp.argmax(logits, -1) == batch["y"]
        return {"loss": jnp.sum(losses * batch["mask"]), "correct": jnp.sum(correct * batch["mask"]),
                "count": jnp.sum(batch["mask"])}

    def summarize(totals):
        return {"eval_accuracy": totals["correct"] / totals["count"], "eval_loss": totals["loss"] / totals["count"]}

    return Task(loss_fn, eval_fn, summarize)


def language_model(model: nn.Module, takes_train: bool = False, compute_dtype_logits: bool | None = None) -> Task:
    """Next-token cross-entropy averaged over every token; held-out loss (nats/token) and perplexity.
    `takes_train`: the module's `__call__` has a `train` parameter (dropout; the built-in GPT has none).

    `compute_dtype_logits`: the built-in GPT hands its logits to `token_cross_entropy` in its compute
    dtype (`logits_dtype=None`) rather than as a float32 copy. None (the default) does so on a GPU,
    where that copy is a pass of its own over the largest tensor of the step (docs/performance.md,
    "GPUs: GPT-2 small on one H200"). XLA:CPU instead folds the head's bf16 rounding and the upcast
    away and takes the loss from the float32 product, a little more precise and no slower, so CPU
    runs keep that: the same numbers as before."""
    if compute_dtype_logits is None:
        compute_dtype_logits = jax.default_backend() == "gpu"
    if compute_dtype_logits and hasattr(model, "logits_dtype"):
        model = model.clone(logits_dtype=None)
    pallas = kernels.implementation(getattr(model, "kernels", "xla"), getattr(model, "dtype", jnp.float32)) == "pallas"

    def cross_entropy(logits, labels):  # the GPT's --kernels: its 16-bit logits through the Pallas kernel
        if pallas and logits.dtype != jnp.float32:
            return kernels.cross_entropy(logits, labels)
        return token_cross_entropy(logits, labels)

    def loss_fn(params, model_state, batch, rng):
        if takes_train:
            logits, model_state = model.apply({"params": params, **model_state}, batch["x"], train=True,
                                              rngs={"dropout": rng}, mutable=list(model_state))
        else:  # no `train` parameter: a module that drops out always still gets its per-step key
            logits = model.apply({"params": params, **model_state}, batch["x"], rngs={"dropout": rng})
        loss = cross_entropy(logits, batch["y"]).mean()
        return loss, {}, model_state

    def eval_fn(params, model_state, batch):
        logits = model.apply({"params": params, **model_state}, batch["x"], **({"train": False} if takes_train else {}))
        losses = cross_entropy(logits, batch["y"])  # (rows, tokens)
        mask = batch["mask"][:, None]
        return {"loss": jnp.sum(losses * mask), "count": jnp.sum(mask) * losses.shape[1]}

    def summarize(totals):
        loss = totals["loss"] / totals["count"]
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}

    return Task(loss_fn, eval_fn, summarize)


def for_dataset(kind: str, model: nn.Module, takes_train: bool | None = None) -> Task:
    """The task for a dataset kind: "classification" or "tokens". `takes_train` (default: what
    the built-in models do) says whether the module's `__call__` has a `train` parameter."""
    make = {"classification": classification, "tokens": language_model}[kind]
    return make(model) if takes_train is None else make(model, takes_train)
