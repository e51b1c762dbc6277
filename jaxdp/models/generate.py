"""Sampling from a trained language model, on one device.

    from jaxdp.models.generate import generate
    module, params = jaxdp.load_model("/tmp/run")
    new = generate(module, params, prompt_ids, max_new_tokens=200, temperature=0.8, top_k=40)

`generate` returns the new token ids only. Two ways to compute the next token's logits:

* jaxdp's GPT (`jaxdp.models.builtin.GPT`) keeps a key/value cache (`models.KVCache`): the prompt runs
  through the model once, then each new token runs alone, attending to the cached keys and
  values. Each token costs one token's forward pass, so generation is linear in its length.
* any other module (`module.apply({"params": p}, tokens [B, T]) -> logits [B, T, V]`, causal, as
  every next-token model is) runs a full forward pass over the last `context` tokens for every new
  token: quadratic in the context, and the only way that needs nothing from the module.

The GPT's cache holds `context` positions (its position table). Past them, generation continues
with the full forward pass over the last `context` tokens, as for any module. A prompt longer
than `context` keeps its last `context` tokens.

Both loops are a `jax.lax.fori_loop` over the new tokens inside one `jax.jit`, with fixed shapes:
one compilation per (module, prompt shape, token count, sampling mode), none per token.
Temperature 0 is greedy decoding (argmax); `top_k` keeps the k most likely tokens before
sampling. The draws come from `seed`, token i from `fold_in(PRNGKey(seed), i)`, whichever loop
makes it. Bad arguments raise `jaxdp.errors.InputError` with one sentence.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.errors import InputError
from jaxdp.models.builtin import GPT


def generate(module: Any, params: Any, prompt_ids: Any, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0, *, context: int | None = None,
             use_cache: bool = True) -> np.ndarray:
    """The `max_new_tokens` token ids that follow `prompt_ids`, as int32 numpy.

    `prompt_ids`: one prompt of shape (T,) (returns (max_new_tokens,)) or a batch of equally long
    prompts (B, T) (returns (B, max_new_tokens)). `context`: the most tokens the model sees at once
    (default: a GPT's position table, else the module's `seq_len`). `use_cache=False` makes jaxdp's
    GPT recompute every token from scratch too (for checking the cache)."""
    check_options(max_new_tokens, temperature, top_k, seed)
    prompt = _check_prompt(module, prompt_ids)
    context = _context(module, context)
    prompt = prompt[:, -context:]  # a longer prompt keeps its last `context` tokens
    batch, length = prompt.shape
    mode = _Sampling(greedy=temperature == 0, top_k=None if top_k is None else int(top_k))
    key = jax.random.PRNGKey(seed)
    temperature = jnp.float32(temperature or 1.0)
    pieces = []
    cached = 0
    if use_cache and isinstance(module, GPT):
        cached = min(max_new_tokens, context - length + 1)  # the last cached position is context - 1
        if cached > 0:
            pieces.append(_cached_loop(module, params, prompt, cached, temperature, key, mode))
    rest = max_new_tokens - cached
    if rest > 0:
        so_far = np.concatenate([prompt, *map(np.asarray, pieces)], axis=1)[:, -context:]
        window = np.zeros((batch, context), np.int32)
        window[:, :so_far.shape[1]] = so_far  # left-aligned; positions past `filled` are never seen (causal)
        pieces.append(_window_loop(module, params, jnp.asarray(window), jnp.int32(so_far.shape[1]), rest,
                                   jnp.int32(cached), temperature, key, mode))
    new = np.concatenate([np.asarray(p) for p in pieces], axis=1) if pieces else np.zeros((batch, 0), np.int32)
    return new[0] if np.ndim(prompt_ids) == 1 else new


# ---- sampling ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Sampling:
    """The static part of the sampling choice (the temperature is traced: no recompilation)."""

    greedy: bool
    top_k: int | None


def _sample(logits: jax.Array, temperature: jax.Array, key: jax.Array, mode: _Sampling) -> jax.Array:
    """One token id per row of `logits` [B, V]."""
    if mode.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if mode.top_k is not None and mode.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, mode.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# ---- the two loops -----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("module", "count", "mode"))
def _cached_loop(module: GPT, params: Any, prompt: jax.Array, count: int, temperature: jax.Array, key: jax.Array,
                 mode: _Sampling) -> jax.Array:
    """`count` tokens from jaxdp's GPT with its KV cache: the prompt in one pass, then one token a pass."""
    variables = {"params": params}
    logits, cache = module.apply(variables, prompt, module.init_cache(prompt.shape[0]))
    first = _sample(logits[:, -1], temperature, jax.random.fold_in(key, 0), mode)
    out = jnp.zeros((prompt.shape[0], count), jnp.int32).at[:, 0].set(first)

    def body(i, carry):
        out, cache = carry
        previous = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)  # [B, 1]: the token just made
        logits, cache = module.apply(variables, previous, cache)
        token = _sample(logits[:, 0], temperature, jax.random.fold_in(key, i), mode)
        return out.at[:, i].set(token), cache

    out, _ = jax.lax.fori_loop(1, count, body, (out, cache))
    return out


@functools.partial(jax.jit, static_argnames=("module", "count", "mode"))
def _window_loop(module: Any, params: Any, window: jax.Array, filled: jax.Array, count: int, first_index: jax.Array,
                 temperature: jax.Array, key: jax.Array, mode: _Sampling) -> jax.Array:
    """`count` tokens, each from a full forward pass over `window` [B, context] (quadratic in the
    context): its first `filled` positions hold the latest tokens; once full, it slides by one."""
    variables = {"params": params}
    size = window.shape[1]

    def body(i, carry):
        out, window, filled = carry
        logits = module.apply(variables, window)  # [B, context, V]
        last = jax.lax.dynamic_index_in_dim(logits, filled - 1, axis=1, keepdims=False)
        token = _sample(last.astype(jnp.float32), temperature, jax.random.fold_in(key, first_index + i), mode)
        full = filled == size
        window = jnp.where(full, jnp.roll(window, -1, axis=1), window)
        window = jax.lax.dynamic_update_slice(window, token[:, None], (0, jnp.where(full, size - 1, filled)))
        return out.at[:, i].set(token), window, jnp.minimum(filled + 1, size)

    out = jnp.zeros((window.shape[0], count), jnp.int32)
    out, _, _ = jax.lax.fori_loop(0, count, body, (out, window, filled))
    return out


# ---- arguments ---------------------------------------------------------------------------------


def check_options(max_new_tokens: int, temperature: float, top_k: int | None, seed: int) -> None:
    """InputError naming the first bad sampling option (`generate` checks them; a command line may
    check them before it loads a model)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}", argument="max_new_tokens")
    if not isinstance(temperature, (int, float, np.floating)) or not math.isfinite(temperature) or temperature < 0:
        raise InputError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}",
                         argument="temperature")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise InputError(f"top_k must be a positive integer or None, got {top_k!r}", argument="top_k")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise InputError(f"seed must be an integer between 0 and {2**32 - 1}, got {seed!r}", argument="seed")


def _check_prompt(module: Any, prompt_ids: Any) -> np.ndarray:
    """The prompt as int32 [B, T], or InputError saying what is wrong with it."""
    prompt = np.asarray(prompt_ids)
    if prompt.ndim == 1:
        prompt = prompt[None]
    if prompt.ndim != 2 or prompt.shape[1] == 0 or prompt.shape[0] == 0:
        raise InputError(f"prompt_ids must be a non-empty sequence of token ids (T,) or a batch (B, T), got shape "
                         f"{np.shape(prompt_ids)}", argument="prompt_ids")
    if prompt.dtype.kind not in "iu":
        raise InputError(f"prompt_ids must be integer token ids, got {prompt.dtype}", argument="prompt_ids")
    vocab = getattr(module, "vocab_size", None)
    if prompt.min() < 0 or (isinstance(vocab, int) and prompt.max() >= vocab):
        raise InputError(f"prompt_ids must be token ids between 0 and {vocab - 1 if isinstance(vocab, int) else '...'}"
                         f", got {int(prompt.min())} to {int(prompt.max())}", argument="prompt_ids")
    return prompt.astype(np.int32)


def model_context(module: Any) -> int | None:
    """The most tokens `module` sees at once: a GPT's position table, else its `seq_len` (None if it has none)."""
    context = module.context if isinstance(module, GPT) else getattr(module, "seq_len", None)
    return context if isinstance(context, int) and not isinstance(context, bool) else None


def _context(module: Any, context: int | None) -> int:
    if context is None:
        context = model_context(module)
        if context is None:
            raise InputError(f"{type(module).__name__} has no seq_len field: pass context=N, the most tokens it "
                             f"takes at once", argument="context")
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context < 1:
        raise InputError(f"context must be a positive integer, got {context!r}", argument="context")
    if isinstance(module, GPT) and context > module.context:
        raise InputError(f"context={context} is more than the GPT's {module.context} positions", argument="context")
    return int(context)
