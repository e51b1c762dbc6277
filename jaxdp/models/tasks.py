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
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class Task:
    loss_fn: Callable
    eval_fn: Callable
    summarize: Callable[[dict[str, float]], dict[str, float]]


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


def language_model(model: nn.Module, takes_train: bool = False) -> Task:
    """Next-token cross-entropy averaged over every token; held-out loss (nats/token) and perplexity.
    `takes_train`: the module's `__call__` has a `train` parameter (dropout; the built-in GPT has none)."""

    def loss_fn(params, model_state, batch, rng):
        if takes_train:
            logits, model_state = model.apply({"params": params, **model_state}, batch["x"], train=True,
                                              rngs={"dropout": rng}, mutable=list(model_state))
        else:  # no `train` parameter: a module that drops out always still gets its per-step key
            logits = model.apply({"params": params, **model_state}, batch["x"], rngs={"dropout": rng})
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {}, model_state

    def eval_fn(params, model_state, batch):
        logits = model.apply({"params": params, **model_state}, batch["x"], **({"train": False} if takes_train else {}))
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])  # (rows, tokens)
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
