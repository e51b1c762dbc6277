"""Built-in Flax models. Modules only: nothing here knows about meshes or devices.

The CNN's BatchNorm takes an optional `axis_name`: inside a jaxdp step it is the mesh's axis, so batch
statistics are computed over the whole global batch (synchronised BatchNorm) and the model trains
exactly as it would on one device; outside a mapped context (evaluation, a single-device
reference) it is None.
"""

from __future__ import annotations

import functools
import math

from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxdp.models import blocks, fp8, kernels


class MLP(nn.Module):
    """Flatten, then Dense + ReLU (+ dropout) per hidden layer, then a linear classifier."""

    hidden: Sequence[int] = (256, 256)
    num_classes: int = 10
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32  # compute dtype; parameters stay float32

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(nn.Dense(width, dtype=self.dtype)(x))
            if self.dropout_rate:
                x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


class CNN(nn.Module):
    """Two conv blocks with BatchNorm, global average pooling, a linear classifier."""

    features: Sequence[int] = (32, 64)
    num_classes: int = 10
    axis_name: str | None = None  # the mesh's axis name for synchronised BatchNorm
    dtype: Any = jnp.float32  # compute dtype; parameters and batch statistics stay float32

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
        for width in self.features:
            x = nn.Conv(width, (3, 3), dtype=self.dtype)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name, dtype=self.dtype)(x)
            x = nn.relu(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


class KVCache(NamedTuple):
    """The keys and values of every token a GPT has seen so far, for generation one token at a time.

    `keys[i]` and `values[i]` are layer i's, of shape (batch, context, heads, head_dim) in the
    module's compute dtype; positions `length` and beyond are not written yet (zeros, masked out).
    Make one with `GPT.init_cache(batch)`; `GPT.__call__(tokens, cache)` returns the next one.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    length: jax.Array  # int32 scalar: how many positions are filled


class GPT(nn.Module):
    """A decoder-only transformer (GPT-2 layout: pre-LayerNorm blocks, causal attention, GELU MLP).

    Parameters are float32; `dtype` is the compute dtype (bfloat16 for mixed precision: matmuls
    and attention in bf16, LayerNorm statistics and the loss in float32). Used by
    `python -m jaxdp.bench gpt` for throughput and MFU; `flops_per_token` is the model-FLOPs count
    that MFU divides by.

    The defaults are jaxdp's own GPT (its checkpoints depend on them), but for `head_bias`: the
    command line's `--model gpt` has none unless --head-bias, as GPT-2 (its older checkpoints,
    which record no head-bias, had one: jaxdp.config.RECORDED_BEFORE). Hugging Face GPT-2 is
    `ln_epsilon=1e-5, tie_embeddings=True, head_bias=False, max_positions=n_positions` with the
    tanh GELU (`jaxdp.models.hf.read_gpt2` gives these). The parameters map one to one: GPT-2's `c_attn`
    [d, 3d] is `qkv_i` [d, 3, heads, head_dim], its `c_proj` [d, d] is `proj_i` [heads, head_dim, d].

    `module.apply({"params": p}, tokens)` gives the logits of every position; with a `KVCache`,
    `module.apply({"params": p}, tokens, cache)` gives `(logits, cache)` for `tokens` placed after
    the cache's `length` positions, attending to them and to each other causally (jaxdp/models/generate.py).
    """

    vocab_size: int = 50304
    seq_len: int = 1024  # training sequence length (the attention FLOPs of flops_per_token)
    layers: int = 12
    d_model: int = 768
    heads: int = 12
    dtype: Any = jnp.float32
    attention: str = "auto"  # "auto", "xla" or "cudnn": see attention_implementation
    ln_epsilon: float = 1e-6  # flax's LayerNorm default; GPT-2: 1e-5
    tie_embeddings: bool = False  # True: logits = x @ embed.T, no head (GPT-2)
    head_bias: bool = True  # the untied head's bias (GPT-2 has none); a tied head has no bias. The CLI's
                            # --model gpt sets it from --head-bias (default False: it exports to GPT-2)
    max_positions: int | None = None  # rows of the position table (GPT-2: n_positions); None: seq_len
    logits_dtype: Any = jnp.float32  # the returned logits' dtype; None: the compute dtype, for a loss that
    # upcasts as it reads (jaxdp.models.tasks.token_cross_entropy: no float32 copy of the logits)
    gelu_approximate: bool = True  # the tanh GELU (GPT-2's "gelu_new"); False: the exact erf one
    kernels: str = "auto"  # the LayerNorms' and the loss's path: "auto", "xla" or "pallas" (jaxdp/models/kernels.py)
    fp8: bool = False  # the blocks' dense layers on fp8 operands (jaxdp/models/fp8.py; --precision fp8)
    init_std: float | None = 0.02  # GPT-2's initialisation: weights and embeddings normal(init_std), the residual
    # projections (proj_i, fc_out_i) normal(init_std / sqrt(2 x layers)), biases 0; None: flax's defaults
    # (lecun normal), as jaxdp's GPT had before (an initialisation only: checkpoints do not depend on it)

    @property
    def context(self) -> int:
        """The most positions the model can see: the size of its position table."""
        return self.seq_len if self.max_positions is None else self.max_positions

    @nn.compact
    def __call__(self, tokens: jnp.ndarray, cache: KVCache | None = None) -> Any:
        if self.tie_embeddings and self.head_bias:
            raise ValueError("GPT(tie_embeddings=True) has no head and so no head bias: pass head_bias=False")
        if self.max_positions is not None and self.max_positions < self.seq_len:
            raise ValueError(f"GPT(max_positions={self.max_positions}) must be at least seq_len={self.seq_len}")
        length = tokens.shape[1]
        start = 0 if cache is None else cache.length
        weights, _, embedding = _initializers(self)
        # Rows are looked up in the float32 tables and then cast (the same values as a lookup in a bf16
        # copy), so the tables' gradient is a float32 scatter-add: in bf16, a GPU adds colliding rows
        # (every token of a frequent one) through compare-and-swap loops, many times slower.
        embed = nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype, name="embed", promote_dtype=_rows_float32,
                         **embedding)
        positions = jnp.arange(length) + start
        pos = nn.Embed(self.context, self.d_model, dtype=self.dtype, name="pos", promote_dtype=_rows_float32, **embedding)
        x = embed(tokens).astype(self.dtype) + pos(positions).astype(self.dtype)
        head_dim = self.d_model // self.heads
        # The cached path attends over the whole cache with a mask, which only XLA's attention takes.
        implementation = attention_implementation(self.attention, self.dtype, head_dim) if cache is None else "xla"
        keys, values = [], []
        if cache is None and blocks.active():  # a step that runs the blocks itself (jaxdp/models/blocks.py)
            block = GPTBlock(**{f: getattr(self, f) for f in BLOCK_FIELDS}, implementation=implementation, parent=None)
            x = blocks.run(x, [{part: f"{part}_{i}" for part in BLOCK_PARTS} for i in range(self.layers)],
                           lambda p, h: block.apply({"params": p}, h))
        else:
            for i in range(self.layers):

                def attend(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, i: int = i) -> jnp.ndarray:
                    if cache is None:
                        return causal_attention(q, k, v, implementation)
                    k = jax.lax.dynamic_update_slice(cache.keys[i], k.astype(cache.keys[i].dtype), (0, start, 0, 0))
                    v = jax.lax.dynamic_update_slice(cache.values[i], v.astype(cache.values[i].dtype), (0, start, 0, 0))
                    keys.append(k)
                    values.append(v)
                    visible = jnp.arange(k.shape[1])[None, :] <= positions[:, None]  # (query, key): causal
                    return jax.nn.dot_product_attention(q, k, v, mask=visible[None, None], implementation=implementation)

                x = _block(self, x, f"_{i}", attend)
        x = _norm(self, "ln_final")(x)
        if self.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = nn.Dense(self.vocab_size, use_bias=self.head_bias, dtype=self.dtype, name="head",
                              dot_general=dense_dot_general, **weights)(x)
        if self.logits_dtype is not None:
            logits = logits.astype(self.logits_dtype)
        if cache is None:
            return logits
        return logits, KVCache(tuple(keys), tuple(values), cache.length + length)

    def init_cache(self, batch: int) -> KVCache:
        """An empty cache for `batch` sequences of up to `context` tokens."""
        shape = (batch, self.context, self.heads, self.d_model // self.heads)
        empty = tuple(jnp.zeros(shape, self.dtype) for _ in range(self.layers))
        return KVCache(empty, empty, jnp.zeros((), jnp.int32))

    def flops_per_token(self, params: Any) -> float:
        """Training FLOPs per token, the count MFU is defined with (PaLM paper, appendix B): 6 per
        weight (2 forward, 4 backward) for every parameter but the embedding tables (lookups, not
        matmuls), plus 12 * layers * d_model * seq_len for attention scores and weighted values
        (the full matrix, not halved for the causal mask). A tied head's matmul (the token table
        used as the output layer) counts: it is a matmul, like an untied head's."""
        n = sum(x.size for x in jax.tree.leaves(params))
        n -= params["pos"]["embedding"].size + (0 if self.tie_embeddings else params["embed"]["embedding"].size)
        return 6 * n + 12 * self.layers * self.d_model * self.seq_len


def _rows_float32(*arrays: Any, dtype: Any = None, inexact: bool = True) -> list:
    """`nn.Embed(promote_dtype=...)`: a lookup (one array, the table) keeps the table's float32; a tied
    head's `attend` (the query and the table) promotes both to the compute dtype, as flax does."""
    if len(arrays) == 1:
        return list(arrays)
    return nn.dtypes.promote_dtype(*arrays, dtype=dtype, inexact=inexact)


def _initializers(m: Any) -> tuple[dict, dict, dict]:
    """Keyword arguments for the Dense layers, the residual projections and the embeddings of the GPT `m`."""
    if m.init_std is None:
        return {}, {}, {}
    normal = nn.initializers.normal
    return ({"kernel_init": normal(m.init_std)},
            {"kernel_init": normal(m.init_std / math.sqrt(2 * m.layers))},
            {"embedding_init": normal(m.init_std)})


# One block's parameters, by their names in the GPT's tree (`qkv_3` is block 3's `qkv`), and the
# GPT fields a block reads.
BLOCK_PARTS = ("ln_attn", "qkv", "proj", "ln_mlp", "fc", "fc_out")
BLOCK_FIELDS = ("d_model", "heads", "layers", "dtype", "ln_epsilon", "gelu_approximate", "init_std", "kernels", "fp8")


def _norm(m: Any, name: str) -> nn.Module:
    """The GPT `m`'s LayerNorm called `name`: flax's, or the Pallas kernel's (the same parameters)."""
    if kernels.implementation(m.kernels, m.dtype) == "pallas":
        return kernels.LayerNorm(epsilon=m.ln_epsilon, dtype=m.dtype, name=name)
    return nn.LayerNorm(epsilon=m.ln_epsilon, dtype=m.dtype, name=name)


def _block(m: Any, x: jnp.ndarray, suffix: str, attend: Callable) -> jnp.ndarray:
    """One pre-LayerNorm block, its modules made in `m`'s scope (the GPT's, names `qkv{suffix}`...,
    or a GPTBlock's); `attend(q, k, v)` is the attention (with or without a cache)."""
    weights, residual, _ = _initializers(m)
    head_dim = m.d_model // m.heads
    product = {"dot_general": functools.partial(dense_dot_general, product=fp8.matmul)} if m.fp8 else {}
    dense = product or {"dot_general": dense_dot_general}
    h = _norm(m, f"ln_attn{suffix}")(x)
    qkv = nn.DenseGeneral((3, m.heads, head_dim), dtype=m.dtype, name=f"qkv{suffix}", **product, **weights)(h)
    attn = attend(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
    x = x + nn.DenseGeneral(m.d_model, axis=(-2, -1), dtype=m.dtype, name=f"proj{suffix}", **product, **residual)(attn)
    h = _norm(m, f"ln_mlp{suffix}")(x)
    h = nn.Dense(4 * m.d_model, dtype=m.dtype, name=f"fc{suffix}", **dense, **weights)(h)
    h = nn.gelu(h, approximate=m.gelu_approximate)
    return x + nn.Dense(m.d_model, dtype=m.dtype, name=f"fc_out{suffix}", **dense, **residual)(h)


class GPTBlock(nn.Module):
    """One of the GPT's blocks on its own: parameters `{"qkv": ..., "fc": ...}` (BLOCK_PARTS), the
    GPT's block i being `{part: params[f"{part}_{i}"]}`. What a step that runs the blocks itself
    applies (jaxdp/models/blocks.py); the same modules and arithmetic as the GPT's loop."""

    d_model: int
    heads: int
    layers: int
    dtype: Any
    ln_epsilon: float
    gelu_approximate: bool
    init_std: float | None
    kernels: str
    fp8: bool
    implementation: str

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        return _block(self, x, "", lambda q, k, v: causal_attention(q, k, v, self.implementation))


def causal_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, implementation: str) -> jnp.ndarray:
    """Causal self-attention over `(batch, length, heads, head_dim)`: cuDNN's fused kernel, or XLA's.

    XLA's is written here rather than taken from `jax.nn.dot_product_attention`, with the same
    arithmetic (float32 scores scaled after the product, a large negative where a key is in the
    future, a float32 softmax, probabilities in the values' dtype) cut into at most 8 blocks of
    queries: block i attends to the keys up to its own end only, so the scores of keys every query
    of the block would mask are neither computed nor written, and each block's scores stay small.
    A key a query may not see contributes an exact zero either way, so the output is the whole
    matrix's to rounding. Why: XLA:CPU writes the whole-matrix form's scores, mask and softmax out
    in full where torch runs a fused kernel (figures: docs/performance.md, "The built-in GPT against
    nanoGPT").
    """
    if implementation != "xla":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    length, head_dim = q.shape[1], q.shape[3]
    cuts = min(max(length // 32, 1), 8)
    ends = [round(length * (i + 1) / cuts) for i in range(cuts)]
    scores_dtype = jnp.promote_types(q.dtype, jnp.float32)
    scale = jnp.asarray(1.0 / math.sqrt(head_dim), scores_dtype)
    out, start = [], 0
    for end in ends:
        scores = _scores(q[:, start:end], k[:, :end], scores_dtype) * scale
        visible = jnp.arange(end)[None, :] <= jnp.arange(start, end)[:, None]  # (query, key)
        scores = jnp.where(visible, scores, -0.7 * jnp.finfo(jnp.float32).max).astype(jnp.float32)
        probs = jax.nn.softmax(scores, axis=-1).astype(k.dtype)
        out.append(jnp.einsum("bnts,bsnh->btnh", probs, v[:, :end]))
        start = end
    return jnp.concatenate(out, axis=1)


def _scores(q: jnp.ndarray, k: jnp.ndarray, dtype: Any) -> jnp.ndarray:
    """`q kᵀ` per head in `dtype`, 16-bit inputs with float32 accumulation named explicitly as JAX's
    attention does (the default can mix types in the backward pass, jax-ml/jax#24047), and the
    default precision where a platform refuses that algorithm."""
    algorithm = {jnp.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
                 jnp.dtype(jnp.float16): jax.lax.DotAlgorithmPreset.F16_F16_F32}.get(jnp.dtype(q.dtype))
    try:
        return jnp.einsum("btnh,bsnh->bnts", q, k, precision=algorithm, preferred_element_type=dtype)
    except Exception:  # noqa: BLE001 - the platform's refusal has no public type
        return jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=dtype)


def dense_dot_general(x: jnp.ndarray, kernel: jnp.ndarray, dimension_numbers: Any, precision: Any = None,
                      preferred_element_type: Any = None, product: Callable | None = None) -> jnp.ndarray:
    """`lax.dot_general` for `nn.Dense(dot_general=...)`: the same product as one matrix product, the
    leading dimensions of `x` (batch, positions) flattened into its rows. `product(rows, kernel)`, if
    given, is that matrix product (`jaxdp.models.fp8.matmul`); it takes only a dense layer's
    dimension numbers (ValueError otherwise).

    Why: on a `(batch, positions, features)` input, the kernel's gradient contracts two dimensions of
    `x`, a form XLA:CPU's fast matrix kernels (YNNPACK) do not take, so it runs on a slower fallback
    (figures: docs/performance.md, "The built-in GPT against nanoGPT"). Flattened, the gradient is a
    plain `xᵀ g`. The reshapes are free (row-major), on every platform.
    """
    (x_axes, k_axes), batch = dimension_numbers
    contracted = len(x_axes)
    if any(batch) or tuple(x_axes) != tuple(range(x.ndim - contracted, x.ndim)) or tuple(k_axes) != tuple(range(contracted)):
        if product is not None:
            raise ValueError(f"{getattr(product, '__name__', product)} takes a dense layer's product, not dimension "
                             f"numbers {dimension_numbers}")
        return jax.lax.dot_general(x, kernel, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)
    inner = math.prod(kernel.shape[:contracted])
    rows, matrix = x.reshape(-1, inner), kernel.reshape(inner, -1)
    out = product(rows, matrix) if product is not None else jax.lax.dot_general(
        rows, matrix, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=preferred_element_type)
    return out.reshape(*x.shape[:x.ndim - contracted], *kernel.shape[contracted:])


def attention_implementation(requested: str, dtype: Any, head_dim: int, device: Any = None) -> str:
    """Which `jax.nn.dot_product_attention` implementation the GPT uses: "xla" or "cudnn".

    "auto" picks cuDNN's fused flash attention where it runs: an NVIDIA GPU of compute capability
    8.0 or newer (Ampere, Hopper, Blackwell), a 16-bit compute dtype (bf16 or fp16) and a head
    size that is a multiple of 8 up to 128. Everywhere else (CPUs, float32, other GPUs) it picks
    XLA's own attention. `jax.nn.dot_product_attention` with no implementation chose the XLA
    path even on an H100, at half cuDNN's speed for GPT-2-small (README "Performance").
    """
    if requested not in ("auto", "xla", "cudnn"):
        raise ValueError(f"attention must be auto, xla or cudnn, got {requested!r}")
    if requested != "auto":
        return requested
    device = jax.devices()[0] if device is None else device
    capability = getattr(device, "compute_capability", "0")
    on_nvidia = device.platform == "gpu" and "nvidia" in device.device_kind.lower()
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    fits = head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if on_nvidia and float(capability) >= 8.0 and sixteen_bit and fits else "xla"


# GPT fields beyond the command line's, which express Hugging Face GPT-2 (jaxdp/models/hf.py).
GPT_OPTIONS = ("ln_epsilon", "tie_embeddings", "head_bias", "max_positions", "gelu_approximate")


def build_mlp(config: Any, num_outputs: int, axis_name: str | None = None) -> nn.Module:
    del axis_name  # no cross-device statistics
    return MLP(num_classes=num_outputs, dtype=compute_dtype(config.precision))


def build_cnn(config: Any, num_outputs: int, axis_name: str | None = None) -> nn.Module:
    return CNN(num_classes=num_outputs, axis_name=axis_name, dtype=compute_dtype(config.precision))


def build_gpt(config: Any, num_outputs: int, axis_name: str | None = None) -> nn.Module:
    del axis_name
    # The GPT-2 options are read where `config` has them (a config built for jaxdp.models.hf); a
    # command-line Config has only head_bias (--head-bias) and gets jaxdp's own GPT otherwise.
    options = {name: getattr(config, name) for name in GPT_OPTIONS if hasattr(config, name)}
    return GPT(vocab_size=num_outputs, seq_len=config.seq_len, layers=config.layers, d_model=config.d_model,
               heads=config.heads, dtype=compute_dtype(config.precision), attention=config.attention,
               kernels=getattr(config, "kernels", "auto"), fp8=config.precision == "fp8", **options)



def compute_dtype(precision: str) -> Any:
    """--precision to a dtype: "fp32", or "bf16" and "fp8" (fp8's products inside bf16; parameters stay
    float32 either way)."""
    return {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.bfloat16}[precision]


def build_model(name: str, config: Any, num_outputs: int, axis_name: str | None = None) -> nn.Module:
    """The built-in model called `name` in `jaxdp.registry.MODELS`, sized by `config`'s fields."""
    from jaxdp.registry import MODELS

    return MODELS[name](config, num_outputs, axis_name)
