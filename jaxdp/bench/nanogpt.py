"""`python -m jaxdp.bench nanogpt`: jaxdp's GPT through `python -m jaxdp.train` against nanoGPT's recipe in
PyTorch, on the same bytes, the same batches and the same held-out windows; held-out nats/byte every
`--eval-every` steps, and steps/s.

    python -m jaxdp.bench nanogpt --steps 1000 --seeds 0,1 --json nanogpt.json
    python -m jaxdp.bench nanogpt --steps 60 --seeds 0 --devices default,1,2,8 --eval-batches 4   # speed

--devices runs the jaxdp side once per entry (`default`: no --devices flag, the command line's own
choice); --cpus pins both sides to those cores (torch.set_num_threads to their count). Each row has
steps/s (the median logged rate past the first log for jaxdp, the median timed step for nanoGPT) and
`cpu_s`, the CPU-seconds (user + system) of the whole side, start-up included.

The text (default: the Python standard library's sources, about 12 MB, text nobody here wrote) is read
byte-level; both sides take their training batches from `jaxdp.data.tokens.TokenDataset.train_batch(step)`
and evaluate on its first `--eval-batches` held-out batches, so only the model, its initialisation and
the optimizer differ. The shape and recipe are the issue's: 4 layers, 4 heads, width 128, 128 tokens,
batch 32, AdamW (lr 1e-3, betas 0.9/0.999, weight decay 0.1), 100 warm-up steps, cosine to 1e-4, clip 1.0,
float32.

nanoGPT's recipe, written out here (`NanoGPT`, `nanogpt_optimizer`): token and position embeddings
normal(0.02), the head tied to the token embedding and without a bias, LayerNorm with a bias and eps
1e-5, the exact (erf) GELU, every Linear normal(0.02) with zero bias except the residual projections
(attention output, MLP output) at 0.02 / sqrt(2 x layers), and weight decay on the matrices and
embeddings only (parameters of two or more dimensions). Needs torch (the `bench` extra).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxdp.bench.report import print_table

SHAPE = {"layers": 4, "heads": 4, "d_model": 128, "seq_len": 128, "batch_size": 32}
RECIPE = {"lr": 1e-3, "weight_decay": 0.1, "warmup_steps": 100, "final_lr_fraction": 0.1, "clip_norm": 1.0}


def register(subparsers) -> None:
    p = subparsers.add_parser("nanogpt", help="jaxdp's GPT against nanoGPT's recipe (PyTorch), held-out nats/byte "
                                              "per step and steps/s on the same bytes and batches")
    p.add_argument("--dataset", help="a text file (default: the Python standard library's sources, --corpus-mb MB)")
    p.add_argument("--corpus-mb", type=float, default=12.0)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-batches", type=int, default=50, help="held-out batches per evaluation (the same on both sides)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--sides", default="jaxdp,nanogpt", help="comma-separated: jaxdp, nanogpt")
    p.add_argument("--devices", default="1", help="comma-separated --devices for the jaxdp side, one run each; "
                                                  "default: the command line's own choice")
    p.add_argument("--cpus", default="", help="pin both sides to these cores, e.g. 0 or 0,1 (default: unpinned)")
    p.add_argument("--log-every", type=int, default=0, help="the jaxdp side's --log-every (0: --eval-every)")
    p.add_argument("--train-args", default="", help="extra flags for the jaxdp side")
    p.add_argument("--json", help="write the results here")
    p.set_defaults(run=run)


def stdlib_corpus(path: Path, megabytes: float) -> Path:
    """The standard library's .py sources (tests left out), sorted by path, up to `megabytes`."""
    if path.exists():
        return path
    root, limit, parts, size = Path(sysconfig.get_paths()["stdlib"]), int(megabytes * 2**20), [], 0
    for source in sorted(root.rglob("*.py")):
        if {"test", "tests", "idle_test", "site-packages"} & set(source.relative_to(root).parts):
            continue
        data = source.read_bytes()
        parts.append(data)
        size += len(data)
        if size >= limit:
            break
    path.write_bytes(b"".join(parts)[:limit])
    return path


def run(args) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="jaxdp-nanogpt-"))
    text = Path(args.dataset) if args.dataset else stdlib_corpus(work / "stdlib.txt", args.corpus_mb)
    cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else None
    if cpus:
        os.sched_setaffinity(0, cpus)  # this process (the nanoGPT side) and, inherited, the jaxdp side's
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for side in args.sides.split(","):
            for devices in (args.devices.split(",") if side == "jaxdp" else [None]):
                before = _cpu_seconds()
                result = (run_jaxdp(text, seed, args, work, devices) if side == "jaxdp" else run_nanogpt(text, seed, args))
                row = {"side": side if devices is None else f"jaxdp --devices {devices}", "seed": seed,
                       "devices": devices, "threads": len(os.sched_getaffinity(0)), **result}
                results.append({**row, "cpu_s": _cpu_seconds() - before})
                print(json.dumps(results[-1]), flush=True)
    steps = sorted({s for r in results for s in r["held_out"]}, key=int)
    print_table([{"side": r["side"], "seed": r["seed"], **{f"at{s}": r["held_out"].get(s) for s in steps},
                  "steps_per_s": r["steps_per_s"], "cpu_s": r["cpu_s"], "wall_s": r["wall_s"]} for r in results],
                [("side", "side", "s"), ("seed", "seed", "d"), *((f"at{s}", f"nats/byte @{s}", ".4f") for s in steps),
                 ("steps_per_s", "steps/s", ".2f"), ("cpu_s", "CPU s", ".1f"), ("wall_s", "wall s", ".1f")])
    if args.json:
        Path(args.json).write_text(json.dumps({"dataset": str(text), "bytes": text.stat().st_size, "shape": SHAPE,
                                               "recipe": RECIPE, "steps": args.steps, "results": results}, indent=1))
    return results


def _cpu_seconds() -> float:
    """User + system CPU-seconds of this process and its finished children."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_jaxdp(text: Path, seed: int, args, work: Path, devices: str = "1") -> dict:
    metrics = work / f"jaxdp-{seed}-{devices}.jsonl"
    metrics.unlink(missing_ok=True)
    flags = ["--model", "gpt", "--dataset", str(text), "--layers", SHAPE["layers"], "--heads", SHAPE["heads"],
             "--d-model", SHAPE["d_model"], "--seq-len", SHAPE["seq_len"], "--batch-size", SHAPE["batch_size"],
             "--optimizer", "adamw", "--lr", RECIPE["lr"], "--weight-decay", RECIPE["weight_decay"],
             "--schedule", "warmup-cosine", "--warmup-steps", RECIPE["warmup_steps"],
             "--final-lr-fraction", RECIPE["final_lr_fraction"], "--clip-norm", RECIPE["clip_norm"],
             "--steps", args.steps, "--eval-every", args.eval_every, "--eval-batches", args.eval_batches,
             "--seed", seed, *([] if devices == "default" else ["--devices", devices]),
             "--log-every", args.log_every or args.eval_every, "--metrics-file", metrics,
             "--no-progress", *args.train_args.split()]
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jaxdp.train", *map(str, flags)], check=True,
                   env={**os.environ, "XLA_FLAGS": ""})
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    held = {str(r["step"]): r["eval_loss"] for r in records
            if r.get("event") in ("eval", "done") and "eval_loss" in r}
    logged = [r for r in records if "event" not in r and "steps_per_sec" in r]
    return {"held_out": held, "train_loss": {str(r["step"]): r["loss"] for r in logged},
            "steps_per_s": float(np.median([r["steps_per_sec"] for r in logged[1:]] or [np.nan])),
            "wall_s": time.perf_counter() - started}


def run_nanogpt(text: Path, seed: int, args) -> dict:
    import torch

    from jaxdp.data.tokens import load_tokens

    torch.manual_seed(seed)
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # the cores this process may run on
    data = load_tokens(str(text), SHAPE["seq_len"])
    model = NanoGPT(data.vocab_size, SHAPE["seq_len"], SHAPE["layers"], SHAPE["d_model"], SHAPE["heads"])
    opt = nanogpt_optimizer(model, RECIPE["lr"], RECIPE["weight_decay"])
    held: dict[str, float] = {}

    def evaluate(step: int) -> None:
        model.eval()
        total, count = 0.0, 0.0
        with torch.no_grad():
            for batch in data.eval_batches(SHAPE["batch_size"], 0, 1, args.eval_batches or None):
                x, y, mask = (torch.from_numpy(batch[k]) for k in ("x", "y", "mask"))
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.long().flatten(), reduction="none")
                total += float((loss.view(y.shape).mean(1) * mask).sum())
                count += float(mask.sum())
        held[str(step)] = total / count
        model.train()

    timed, started = [], time.perf_counter()
    for step in range(args.steps):
        lr = cosine_with_warmup(step, args.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = data.train_batch(SHAPE["batch_size"], step, seed)
        x, y = torch.from_numpy(batch["x"]).long(), torch.from_numpy(batch["y"]).long()
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), RECIPE["clip_norm"])
        opt.step()
        timed.append(time.perf_counter() - t0)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evaluate(step + 1)
    return {"held_out": held, "steps_per_s": 1 / float(np.median(timed[10:] or timed)),
            "wall_s": time.perf_counter() - started}


def cosine_with_warmup(step: int, steps: int) -> float:
    """jaxdp's `warmup-cosine` (optax.warmup_cosine_decay_schedule from 0): the learning rate of step `step`."""
    peak, warmup, floor = RECIPE["lr"], RECIPE["warmup_steps"], RECIPE["lr"] * RECIPE["final_lr_fraction"]
    if step < warmup:
        return peak * step / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def _torch_modules():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int, heads: int, layers: int):
            super().__init__()
            self.heads = heads
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)  # eps 1e-5, with a bias
            self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            for residual in (self.c_proj, self.mlp_proj):
                residual.scaled = True

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp_proj(torch.nn.functional.gelu(self.c_fc(self.ln_2(x))))

    class NanoGPT(nn.Module):
        def __init__(self, vocab: int, seq_len: int, layers: int, d: int, heads: int):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
            self.blocks = nn.ModuleList(Block(d, heads, layers) for _ in range(layers))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            self.lm_head.weight = self.wte.weight  # tied
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    std = 0.02 / math.sqrt(2 * layers) if getattr(module, "scaled", False) else 0.02
                    nn.init.normal_(module.weight, std=std)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)
                elif isinstance(module, nn.Embedding):
                    nn.init.normal_(module.weight, std=0.02)

        def forward(self, tokens):
            x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return NanoGPT


def NanoGPT(*args):  # noqa: N802 - a class made on first use, so that importing this module needs no torch
    return _torch_modules()(*args)


def nanogpt_optimizer(model, lr: float, weight_decay: float):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.999))
