"""gpt: a GPT-style decoder (default: GPT-2 small, 124M parameters, sequence 1024) trained with
AdamW through make_train_step, bfloat16 compute: tokens/s, achieved TFLOP/s and MFU (model FLOPs
utilisation) = model FLOPs per step (6 per non-embedding weight per token plus attention, PaLM's
count; XLA's own count is printed beside it) / step time / (peak x devices). Peaks are known for
H100, H200 and A100 in bf16; elsewhere pass --peak-tflops. Meant for a GPU; on CPU use a tiny
model.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from jaxdp.bench.report import print_table, write_json
from jaxdp.bench.timing import interleaved

# Dense bfloat16 peak of one device, TFLOP/s, by a substring of jax's `device_kind` (vendor data
# sheets, SXM parts, without sparsity). Other devices need --peak-tflops for an MFU.
def peak_tflops(device: Any, dtype: str, override: float | None) -> float | None:
    from jaxdp.metrics import peak_tflops as known_peak

    return override or known_peak(device.device_kind, dtype)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("gpt", help="a GPT-style model's train step: tokens/s and MFU (for GPUs)")
    p.add_argument("--devices", type=int, default=1, help="devices (simulated on CPU; default 1)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--batch-size", type=int, default=16, help="global batch size, in sequences")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype (parameters stay float32)")
    p.add_argument("--strategy", default="psum")
    p.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, help="one device's peak for the MFU (default: known GPUs, bf16)")
    p.add_argument("--json")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> list[dict]:
    from jaxdp import distributed
    from jaxdp.config import Config

    config = Config(devices=args.devices, progress=False)
    distributed.initialize(config)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxdp.mesh import make_mesh, shard_batch
    from jaxdp.models import GPT
    from jaxdp.state import init_state
    from jaxdp.step import make_train_step

    mesh = make_mesh(distributed.mesh_devices(config.devices))
    if args.batch_size % mesh.size:
        raise SystemExit(f"jaxdp.bench: --batch-size {args.batch_size} is not divisible by {mesh.size} devices")
    model = GPT(vocab_size=args.vocab_size, seq_len=args.seq_len, layers=args.layers, d_model=args.d_model,
                heads=args.heads, dtype=jnp.dtype(args.dtype))
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, args.vocab_size, (args.batch_size, args.seq_len + 1)).astype(np.int32) for _ in range(2)]
    batches = [shard_batch({"x": t[:, :-1], "y": t[:, 1:]}, mesh) for t in tokens]
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens[0][:1, :-1])["params"]
    tx = optax.adamw(3e-4, weight_decay=0.1)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    step = make_train_step(loss_fn, tx, mesh, args.strategy)
    state = init_state(params, tx, mesh)
    compiled = step.lower(state, batches[0]).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla_flops = float(cost.get("flops", 0.0)) * mesh.size if cost else None  # the per-device program's count

    def run():
        nonlocal state
        for i in range(args.steps):
            state, metrics = step(state, batches[i % 2])
        jax.block_until_ready((state, metrics))

    seconds = interleaved({"gpt": run}, args.repeats, warmup=1)["gpt"]
    step_s = statistics.median(seconds) / args.steps
    tokens_per_step = args.batch_size * args.seq_len
    flops = model.flops_per_token(params) * tokens_per_step
    device = mesh.devices.flat[0]
    peak = peak_tflops(device, args.dtype, args.peak_tflops)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    result = {"model": f"gpt-{args.layers}x{args.d_model}", "params": n_params, "dtype": args.dtype,
              "strategy": args.strategy, "devices": mesh.size, "device_kind": device.device_kind,
              "global_batch": args.batch_size, "seq_len": args.seq_len, "step_s": step_s,
              "tokens_per_s": tokens_per_step / step_s, "model_tflops_per_step": flops / 1e12,
              "xla_tflops_per_step": xla_flops / 1e12 if xla_flops else None,
              "achieved_tflops": flops / step_s / 1e12, "peak_tflops_per_device": peak,
              "mfu": flops / step_s / (peak * 1e12 * mesh.size) if peak else None,
              "repeats": args.repeats, "steps_per_repeat": args.steps}
    print(f"GPT train step ({result['model']}, {n_params / 1e6:.1f}M parameters, {args.dtype}, AdamW), "
          f"global batch {args.batch_size} x {args.seq_len} tokens, {mesh.size} x {device.device_kind}, "
          f"median of {args.repeats} x {args.steps} steps")
    print_table([result], [("step_s", "step ms", ".2f"), ("tokens_per_s", "tokens/s", ".0f"),
                           ("model_tflops_per_step", "model TFLOP/step", ".4g"),
                           ("xla_tflops_per_step", "XLA TFLOP/step", ".4g"),
                           ("achieved_tflops", "TFLOP/s", ".4g"), ("mfu", "MFU", ".3f")])
    if peak is None:
        print(f"no MFU: no known {args.dtype} peak for {device.device_kind!r}; pass --peak-tflops")
    write_json(args.json, [result])
    return [result]
