"""gpt: a GPT-style decoder (default: GPT-2 small, 124M parameters, sequence 1024) trained with
AdamW through make_train_step, bfloat16 compute: tokens/s, achieved TFLOP/s and MFU (model FLOPs
utilisation) = model FLOPs per step (6 per non-embedding weight per token plus attention, PaLM's
count; XLA's own count is printed beside it) / step time / (peak x devices). Peaks are known for
H100, H200 and A100 in bf16; elsewhere pass --peak-tflops. Meant for a GPU; on CPU use a tiny
model.

    python -m jaxdp.bench gpt --json gpt.json
    python -m jaxdp.bench gpt --batch-sizes 16,32 --vs-torch --json gpt.json   # needs torch

--batch-sizes sweeps global batch sizes in one run (--batch-size: one). --vs-torch (one device)
also trains the same model written in PyTorch the nanoGPT way (jaxdp/bench/torch_gpt.py: fused
AdamW on CUDA, bf16 autocast, torch.compile) in the same process, interleaved with the jaxdp step
at each batch size, and reports jaxdp's tokens/s over torch's as a paired ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from jaxdp.bench.report import print_table, write_json
from jaxdp.bench.timing import interleaved, paired_ratio


# Dense bfloat16 peak of one device, TFLOP/s, by a substring of jax's `device_kind` (vendor data
# sheets, SXM parts, without sparsity). Other devices need --peak-tflops for an MFU.
def peak_tflops(device: Any, dtype: str, override: float | None) -> float | None:
    from jaxdp.metrics import peak_tflops as known_peak

    return override or known_peak(device.device_kind, dtype)


def batch_sizes(text: str) -> list[int]:
    """'16,32' -> [16, 32] (--batch-sizes)."""
    sizes = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() and int(t) > 0 for t in sizes):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of positive batch sizes, like 16,32")
    return [int(t) for t in sizes]


def one_batch_size(text: str) -> list[int]:
    """'16' -> [16] (--batch-size: the one-size form of --batch-sizes)."""
    if "," in text:
        raise argparse.ArgumentTypeError(f"{text!r}: --batch-size takes one size; for a list use --batch-sizes")
    return batch_sizes(text)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("gpt", help="a GPT-style model's train step: tokens/s and MFU (for GPUs), optionally vs PyTorch")
    p.add_argument("--devices", type=int, default=1, help="devices (simulated on CPU; default 1)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=50304)
    # Both write one list; the later flag wins.
    p.add_argument("--batch-size", dest="batch_sizes", type=one_batch_size, default=[16], metavar="N",
                   help="global batch size, in sequences (default 16)")
    p.add_argument("--batch-sizes", dest="batch_sizes", type=batch_sizes, metavar="N,N,...",
                   help="global batch sizes to sweep in one run, e.g. 16,32")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype (parameters stay float32)")
    p.add_argument("--strategy", default="psum")
    p.add_argument("--steps", type=int, default=20, help="steps per timed repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, help="one device's peak for the MFU (default: known GPUs, bf16)")
    p.add_argument("--vs-torch", action="store_true",
                   help="also time the same model in PyTorch (nanoGPT-style, one device; needs torch)")
    p.add_argument("--no-compile", dest="torch_compile", action="store_false",
                   help="--vs-torch: run the torch model eager, without torch.compile")
    p.add_argument("--json")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> list[dict]:
    torch = None
    if args.vs_torch:
        from jaxdp.bench.ddp import import_torch

        torch = import_torch()  # exits 2 with the install hint, before JAX starts
        if args.devices != 1:
            raise SystemExit("jaxdp.bench: --vs-torch compares one device with one device; drop --devices")
        # JAX and torch share the GPU in this process. JAX's default is to take 75 % of the GPU's
        # memory when its backend starts, which would leave torch too little; allocating as it
        # goes instead, like torch's caching allocator, lets both fit. It must be set before JAX's
        # backend starts (distributed.initialize, below); a value the user set is kept.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    from jaxdp.cluster import distributed
    from jaxdp.config import Config

    config = Config(devices=args.devices, progress=False)
    distributed.initialize(config)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxdp.mesh import make_mesh, shard_batch
    from jaxdp.models.builtin import GPT
    from jaxdp.models.tasks import language_model
    from jaxdp.step.state import init_state
    from jaxdp.step.train_step import make_train_step

    mesh = make_mesh(distributed.mesh_devices(config.devices))
    for batch_size in args.batch_sizes:
        if batch_size % mesh.size:
            raise SystemExit(f"jaxdp.bench: batch size {batch_size} is not divisible by {mesh.size} devices")
    model = GPT(vocab_size=args.vocab_size, seq_len=args.seq_len, layers=args.layers, d_model=args.d_model,
                heads=args.heads, dtype=jnp.dtype(args.dtype))
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, args.seq_len), jnp.int32))["params"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    flops_per_token = model.flops_per_token(params)
    tx = optax.adamw(3e-4, weight_decay=0.1)  # torch_gpt.py uses the same lr and weight decay

    task = language_model(model)  # the command line's loss (on a GPU: bf16 logits into token_cross_entropy)
    no_dropout = jax.random.PRNGKey(0)  # (the GPT has none)

    def loss_fn(params, batch):
        return task.loss_fn(params, {}, batch, no_dropout)[0]

    step = make_train_step(loss_fn, tx, mesh, args.strategy)
    state = init_state(params, tx, mesh)
    device = mesh.devices.flat[0]
    peak = peak_tflops(device, args.dtype, args.peak_tflops)

    bench_torch = None
    if args.vs_torch:
        from jaxdp.bench import torch_gpt

        bench_torch = torch_gpt.TorchGPTBench(vocab_size=args.vocab_size, seq_len=args.seq_len, layers=args.layers,
                                              d_model=args.d_model, heads=args.heads, dtype=args.dtype,
                                              device=torch_gpt.device_for(device.platform), compile=args.torch_compile)
        if bench_torch.model.num_params() != n_params:
            raise AssertionError(f"the torch model has {bench_torch.model.num_params()} parameters, the JAX one {n_params}")

    def row(impl: str, batch_size: int, seconds: list[float], n: int, flops_per_token: float, **extra: Any) -> dict:
        step_s = statistics.median(seconds) / args.steps
        tokens_per_step = batch_size * args.seq_len
        flops = flops_per_token * tokens_per_step
        return {"impl": impl, "model": f"gpt-{args.layers}x{args.d_model}", "params": n, "dtype": args.dtype,
                "devices": mesh.size, "device_kind": device.device_kind, "global_batch": batch_size,
                "seq_len": args.seq_len, "step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
                "model_tflops_per_step": flops / 1e12, "achieved_tflops": flops / step_s / 1e12,
                "peak_tflops_per_device": peak, "mfu": flops / step_s / (peak * 1e12 * mesh.size) if peak else None,
                "repeats": args.repeats, "steps_per_repeat": args.steps, **extra}

    results = []
    rng = np.random.default_rng(0)
    for batch_size in args.batch_sizes:
        tokens = [rng.integers(0, args.vocab_size, (batch_size, args.seq_len + 1)).astype(np.int32) for _ in range(2)]
        batches = [shard_batch({"x": t[:, :-1], "y": t[:, 1:]}, mesh) for t in tokens]
        cost = step.lower(state, batches[0]).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        xla_flops = float(cost.get("flops", 0.0)) * mesh.size if cost else None  # the per-device program's count

        def jaxdp_steps():
            nonlocal state
            for i in range(args.steps):
                state, metrics = step(state, batches[i % 2])
            jax.block_until_ready((state, metrics))  # a timed case ends when the device is done

        cases = {"jaxdp": jaxdp_steps}
        if bench_torch:
            torch_case = bench_torch.case(tokens)  # runs (and compiles) one step
            cases["torch"] = lambda: torch_case.run(args.steps)
        seconds = interleaved(cases, args.repeats, warmup=1)
        results.append(row("jaxdp", batch_size, seconds["jaxdp"], n_params, flops_per_token, strategy=args.strategy,
                           xla_tflops_per_step=xla_flops / 1e12 if xla_flops else None,
                           # jaxdp tokens/s / torch tokens/s = torch time / jaxdp time, paired by repeat
                           vs_torch=paired_ratio(seconds["torch"], seconds["jaxdp"]) if bench_torch else None))
        if bench_torch:
            results.append(row("torch", batch_size, seconds["torch"], torch_case.params, torch_case.flops_per_token,
                               xla_tflops_per_step=None, vs_torch=None, compiled=torch_case.compiled, note=torch_case.note,
                               first_step_s=torch_case.first_step_s,
                               optimizer="adamw (fused)" if bench_torch.cuda else "adamw",
                               autocast="bfloat16" if bench_torch.autocast else None))

    print(f"GPT train step ({results[0]['model']}, {n_params / 1e6:.1f}M parameters, {args.dtype}, AdamW), "
          f"global batch {','.join(map(str, args.batch_sizes))} x {args.seq_len} tokens, {mesh.size} x {device.device_kind}, "
          f"median of {args.repeats} x {args.steps} steps")
    if bench_torch:
        torch_row = results[-1]
        print(f"torch {torch.__version__} on {bench_torch.device.type}: the same model ({torch_row['params'] / 1e6:.1f}M parameters), "
              f"{torch_row['optimizer']}, {'bf16 autocast' if bench_torch.autocast else 'float32'}, "
              f"{'torch.compile' if torch_row['compiled'] else torch_row['note']}; interleaved with jaxdp, "
              f"x torch = jaxdp tokens/s / torch tokens/s (median of the per-repeat ratios)")
    columns = [("impl", "impl", "s"), ("global_batch", "batch", "d"), ("step_s", "step ms", ".2f"),
               ("tokens_per_s", "tokens/s", ".0f"), ("model_tflops_per_step", "model TFLOP/step", ".4g"),
               ("xla_tflops_per_step", "XLA TFLOP/step", ".4g"), ("achieved_tflops", "TFLOP/s", ".4g"),
               ("mfu", "MFU", ".3f")]
    print_table(results, columns + ([("vs_torch", "x torch", ".3f")] if bench_torch else []))
    if peak is None:
        print(f"no MFU: no known {args.dtype} peak for {device.device_kind!r}; pass --peak-tflops")
    write_json(args.json, results, **({"torch": torch.__version__} if torch else {}))
    return results
