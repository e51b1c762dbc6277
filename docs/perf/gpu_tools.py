"""Helpers for docs/perf/gpu_run.sh, run on a lent GPU from the repository root (PYTHONPATH=.).

    python docs/perf/gpu_tools.py trace OUTDIR --skip K -- <jaxdp.train flags>   # the CLI, profiled from step K
    python docs/perf/gpu_tools.py summarize OUTDIR --steps N             # where a step's time goes
    python docs/perf/gpu_tools.py ce                                   # the head and the loss alone
    python docs/perf/gpu_tools.py kernels --json FILE                  # Pallas and fp8 against XLA, alone
    python docs/perf/gpu_tools.py embed --json FILE                    # the token lookup's gradient, alone
    python docs/perf/gpu_tools.py sample CHECKPOINT_DIR HF_DIR --new-tokens N --json FILE
    python docs/perf/gpu_tools.py variants "default;xla_gpu_enable_triton_gemm=false" --batch 16
    python docs/perf/gpu_tools.py codecs "bf16;int8;int4;powersgd:4;topk:0.01"
    python docs/perf/gpu_tools.py startup -- <jaxdp.train flags>       # a warm start-up, phase by phase

`trace` runs `python -m jaxdp.train` in this process under `jax.profiler.trace` (a Perfetto trace
beside TensorBoard's), so what it records is the command line's own path: the step, its metrics
reads, the preemption check, the prefetch thread. `summarize` reads that trace and prints, per
training step, the device's busy time (the union of its kernels), the kernels grouped (matrix
products, attention, fusions of elementwise work and reductions, copies) and the 25 costliest
kernels. `sample` times `jaxdp.models.generate.generate` (a key/value cache, one compiled loop)
against Hugging Face transformers' `generate` on the same model exported with `python -m jaxdp.export`.
`variants` compiles the command line's GPT-2-small train step (the bench's: `jaxdp.bench gpt`) once per
variant, in one process, and times them interleaved: a variant is XLA options as name=value ("default":
none), passed to that one compilation (`compiler_options`).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import statistics
import sys
import time


def trace(out: str, train_args: list[str], skip: int) -> None:
    """Run the command line in this process; trace from its step `skip` (past compilation) to its end."""
    import jax

    from jaxdp.data import prefetch
    from jaxdp.train import main

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python's frames would swamp the trace (and slow the host)
    started = []
    base = prefetch.Prefetcher

    class Traced(base):  # the step loop's batches: start tracing as batch `skip` is handed out
        def __iter__(self):
            for i, item in enumerate(super().__iter__()):
                if i == skip and not started:
                    jax.profiler.start_trace(out, create_perfetto_trace=True, profiler_options=options)
                    started.append(True)
                yield item

    prefetch.Prefetcher = Traced
    try:
        code = main(train_args)
    finally:
        if started:
            jax.profiler.stop_trace()  # after main: every traced step has finished on the device
    if code:
        raise SystemExit(code)


GROUPS = (("matmul", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "matmul", "dot")),
          ("attention", ("flash", "fmha", "cudnn", "attn", "sdpa")),
          ("copy", ("memcpy", "memset", "copy")),
          ("reduction fusion", ("reduce", "reduction")),
          ("other fusion", ("fusion", "triton", "loop", "kernel")))


def group(name: str) -> str:
    low = name.lower()
    for label, keys in GROUPS:
        if any(k in low for k in keys):
            return label
    return "other"


def summarize(out: str, steps: int) -> dict:
    paths = sorted(glob.glob(os.path.join(out, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        raise SystemExit(f"no perfetto_trace.json.gz under {out}")
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in names.items() if "/device:GPU" in name or "/device:TPU" in name}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids and e.get("dur")]
    host = [e for e in events if e.get("ph") == "X" and e.get("pid") not in device_pids and e.get("dur")]
    result: dict = {"trace": paths[-1], "processes": sorted(set(names.values())), "steps": steps}
    if kernels:
        by_module = collections.Counter()
        for e in kernels:
            by_module[e.get("args", {}).get("hlo_module", "?")] += e["dur"]
        # The training step is the module with the most device time; its executions bound the window.
        train_module = by_module.most_common(1)[0][0]
        mine = [e for e in kernels if e.get("args", {}).get("hlo_module", "?") == train_module]
        start, end = min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine)
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels if start <= e["ts"] <= end)
        busy, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        per_kernel = collections.Counter()
        counts = collections.Counter()
        for e in mine:
            per_kernel[e["name"]] += e["dur"]
            counts[e["name"]] += 1
        groups = collections.Counter()
        for name, dur in per_kernel.items():
            groups[group(name)] += dur
        total = sum(per_kernel.values())
        result.update(train_module=train_module, window_ms=(end - start) / 1e3, busy_ms=busy / 1e3,
                      busy_fraction=busy / (end - start), kernel_ms_per_step=total / 1e3 / steps,
                      kernels_per_step=sum(counts.values()) / steps,
                      groups_ms_per_step={k: v / 1e3 / steps for k, v in groups.most_common()},
                      modules_ms={k: v / 1e3 for k, v in by_module.most_common(8)},
                      top=[{"name": n[:140], "ms_per_step": d / 1e3 / steps, "calls_per_step": counts[n] / steps,
                            "share": d / total} for n, d in per_kernel.most_common(25)])
    hosts = collections.Counter()
    for e in host:
        hosts[e["name"][:100]] += e["dur"]
    result["host_top_ms"] = {k: v / 1e3 for k, v in hosts.most_common(20)}
    return result


def print_summary(s: dict) -> None:
    print(f"trace {s['trace']}")
    if "train_module" not in s:
        print("no device kernels in the trace; processes:", s["processes"])
    else:
        print(f"train module {s['train_module']}: window {s['window_ms']:.1f} ms for {s['steps']} steps, device busy "
              f"{s['busy_fraction']:.3f} of it; kernels {s['kernel_ms_per_step']:.2f} ms/step "
              f"({s['kernels_per_step']:.0f} launches/step)")
        for k, v in s["groups_ms_per_step"].items():
            print(f"  {k:18s} {v:8.2f} ms/step")
        for row in s["top"]:
            print(f"  {row['ms_per_step']:7.3f} ms {row['calls_per_step']:5.1f}x {row['share']:6.1%}  {row['name']}")
    print("host (ms, whole trace):", json.dumps({k: round(v, 1) for k, v in list(s["host_top_ms"].items())[:12]}))


def sample(checkpoint_dir: str, hf_dir: str, new_tokens: int, repeats: int) -> dict:
    import jax
    import numpy as np

    from jaxdp.checkpoint.artifacts import load_model
    from jaxdp.models.generate import generate

    module, params = load_model(checkpoint_dir)
    prompt = np.arange(1, 17, dtype=np.int32)
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        ids = generate(module, params, prompt, new_tokens, temperature=1.0, seed=i)
        jax.block_until_ready(ids)
        np.asarray(ids)
        times.append(time.perf_counter() - t)
    out = {"jaxdp_first_s": times[0], "jaxdp_s": statistics.median(times[1:]),
           "jaxdp_tokens_per_s": new_tokens / statistics.median(times[1:])}
    try:
        import torch
        import transformers
    except ImportError as err:
        out["hf"] = f"not run: {err}"
        return out
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).to(device).eval()
    x = torch.tensor(prompt[None].astype(np.int64), device=device)
    for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        m = model.to(dtype)
        times = []
        for i in range(repeats + 1):
            torch.manual_seed(i)
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                m.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, top_k=0,
                           pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[f"hf_{dtype_name}_s"] = statistics.median(times[1:])
        out[f"hf_{dtype_name}_tokens_per_s"] = new_tokens / statistics.median(times[1:])
    out.update(new_tokens=new_tokens, repeats=repeats, transformers=transformers.__version__, torch=torch.__version__,
               compute_dtype=str(getattr(module, "dtype", "?")))
    return out


def cross_entropy(tokens: int, width: int, vocab: int, repeats: int) -> dict:
    """The head and the loss alone, as a GPT-2-small step has them (bf16 hidden states and head,
    float32 loss), forward and backward: optax on float32 logits (the model's old output) against
    jaxdp.models.tasks.token_cross_entropy on the bf16 logits. Median ms of `repeats` calls each."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxdp.models.tasks import token_cross_entropy

    kx, kw, ky = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (tokens, width), jnp.bfloat16)
    w = (jax.random.normal(kw, (width, vocab)) * 0.02).astype(jnp.bfloat16)
    y = jax.random.randint(ky, (tokens,), 0, vocab)

    def old(x, w):
        return optax.softmax_cross_entropy_with_integer_labels((x @ w).astype(jnp.float32), y).mean()

    def new(x, w):
        return token_cross_entropy(x @ w, y).mean()

    out = {"tokens": tokens, "width": width, "vocab": vocab}
    grads = {}
    for name, f in (("optax_f32", old), ("token_cross_entropy", new)):
        step = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        value, grads[name] = jax.block_until_ready(step(x, w))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(step(x, w))
            times.append(time.perf_counter() - t)
        out[f"{name}_ms"] = 1e3 * statistics.median(times)
        out[f"{name}_loss"] = float(value)
    a, b = grads["optax_f32"], grads["token_cross_entropy"]
    out["max_grad_diff"] = max(float(jnp.max(jnp.abs(p.astype(jnp.float32) - q.astype(jnp.float32)))) for p, q in zip(a, b))
    return out


def option(text: str) -> tuple[str, object]:
    """"name=value" as an XLA option: a boolean, an integer, or else the string."""
    name, value = text.split("=", 1)
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    return name, int(value) if value.lstrip("-").isdigit() else value


def variants(specs: list[str], batch: int, steps: int, repeats: int, budget_s: float) -> dict:
    """Each variant's step time (median of `repeats` x `steps` steps, interleaved) and its compile time;
    no variant starts compiling after `budget_s`. "best_options": the options of the fastest variant
    if it beats "default" by 1 %."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxdp.bench.timing import interleaved, paired_ratio
    from jaxdp.mesh import make_mesh, shard_batch
    from jaxdp.models.builtin import GPT
    from jaxdp.models.tasks import language_model
    from jaxdp.step.state import init_state
    from jaxdp.step.train_step import make_train_step

    mesh = make_mesh(jax.devices()[:1])
    small = {"vocab_size": 512, "seq_len": 64, "layers": 2, "d_model": 64, "heads": 2} if os.environ.get("GPU_SMALL") else {}
    base = GPT(dtype=jnp.bfloat16, **small)  # GPT-2-small's shape (GPU_SMALL=1: a tiny one, to check this on a CPU)
    params = jax.jit(base.init)(jax.random.PRNGKey(0), jnp.zeros((1, base.seq_len), jnp.int32))["params"]
    tokens = np.random.default_rng(0).integers(0, base.vocab_size, (batch, base.seq_len + 1)).astype(np.int32)
    data = shard_batch({"x": tokens[:, :-1], "y": tokens[:, 1:]}, mesh)
    flops = base.flops_per_token(params) * batch * base.seq_len
    task = language_model(base)  # the command line's loss
    out, cases = {"batch": batch, "device": jax.devices()[0].device_kind, "variants": {}}, {}
    began = time.perf_counter()
    for spec in specs:
        if time.perf_counter() - began > budget_s:
            print(f"{spec}: not compiled (--budget-s {budget_s:g} spent)", flush=True)
            continue
        options = dict(option(w) for w in spec.split() if w != "default")
        tx = optax.adamw(3e-4, weight_decay=0.1)
        step = make_train_step(lambda p, b: task.loss_fn(p, {}, b, jax.random.PRNGKey(0))[0], tx, mesh)
        state = init_state(params, tx, mesh)  # each variant its own: its step donates it
        started = time.perf_counter()
        try:
            compiled = step.lower(state, data).compile(compiler_options=options or None)
        except Exception as e:  # noqa: BLE001 - an option this XLA does not know: say so, go on
            out["variants"][spec] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(f"{spec}: {out['variants'][spec]['error']}", flush=True)
            continue
        out["variants"][spec] = {"compile_s": time.perf_counter() - started}
        holder = {"state": state}

        def run(compiled=compiled, holder=holder):
            for _ in range(steps):
                holder["state"], metrics = compiled(holder["state"], data)
            jax.block_until_ready(metrics)
            return float(metrics["loss"])

        out["variants"][spec]["loss_first"] = run()
        cases[spec] = run
        print(f"{spec}: compiled in {out['variants'][spec]['compile_s']:.1f} s", flush=True)
    seconds = interleaved(cases, repeats, warmup=1)
    first = next(iter(cases), None)
    for spec, times in seconds.items():
        ms = statistics.median(times) / steps * 1e3
        row = out["variants"][spec]
        row.update(step_ms=ms, mfu=flops / (ms / 1e3) / 989e12, vs_first=paired_ratio(seconds[first], times))
        print(f"{spec:60s} {ms:7.2f} ms/step  MFU {row['mfu']:.3f}  x first {row['vs_first']:.3f}", flush=True)
    timed = {spec: out["variants"][spec]["step_ms"] for spec in seconds}
    best = min(timed, key=timed.get, default=None)
    out["best_options"] = {}
    if best and "default" in timed and timed[best] < 0.99 * timed["default"]:
        out["best_options"] = dict(option(w) for w in best.split() if w != "default")
    return out


def codecs(names: list[str], repeats: int) -> dict:
    """Median ms of each codec's `mean` over GPT-2-small's gradient (random values), one device."""
    import jax
    import jax.numpy as jnp

    from jaxdp.models.builtin import GPT
    from jaxdp.sync import codecs as table

    small = {"vocab_size": 512, "seq_len": 64, "layers": 2, "d_model": 64, "heads": 2} if os.environ.get("GPU_SMALL") else {}
    model = GPT(dtype=jnp.bfloat16, **small)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, model.seq_len), jnp.int32))["params"]
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    grads = jax.tree.unflatten(tree, [jax.random.normal(k, s.shape, jnp.float32) * 1e-3 for k, s in zip(keys, leaves)])
    size = sum(s.size for s in leaves)
    out = {"device": jax.devices()[0].device_kind, "values": size, "codecs": {}}

    def one_hop(buffer, wire):  # the ring's coded sum on one device: one encode, one decode
        message, residual = wire.encode(buffer)
        return wire.decode(message), residual

    for name in names:
        codec = table.parse(name)
        state = codec.init(grads)
        exchange = one_hop if codec.needs == "coded_sum" else (lambda tree: tree)
        mean = jax.jit(lambda g, s, codec=codec, exchange=exchange: codec.mean(g, s, exchange, 1, jnp.int32(10**6))[:2])
        started = time.perf_counter()
        result = jax.block_until_ready(mean(grads, state))
        compile_s = time.perf_counter() - started
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(mean(grads, state))
            times.append(time.perf_counter() - t)
        error = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(result[0]), jax.tree.leaves(grads)))
        out["codecs"][name] = {"ms": 1e3 * statistics.median(times), "compile_s": compile_s,
                               "bytes": codec.payload_bytes(grads, 8), "max_abs_change": error}
        print(f"{name:16s} {out['codecs'][name]['ms']:8.2f} ms  (compiled in {compile_s:.1f} s)", flush=True)
    return out


def startup(train_args: list[str]) -> dict:
    """The command line in this process, with the end of each start-up phase (s from the start)."""
    began = time.perf_counter()
    marks: dict = {}
    import jax

    from jaxdp.cluster import distributed
    from jaxdp.loop import trainer
    from jaxdp.step import state as state_module

    def timed(module, name, label):
        inner = getattr(module, name)

        def wrapper(*a, **k):
            result = inner(*a, **k)
            marks.setdefault(label, time.perf_counter() - began)
            return result
        setattr(module, name, wrapper)

    marks["imports"] = time.perf_counter() - began
    timed(distributed, "initialize", "backend started (distributed.initialize)")
    timed(state_module, "init_state", "optimizer state built")
    timed(trainer, "begin", "loop starts (startup_s)")
    plain_jit = jax.jit

    def jit(fun, *a, **k):  # the first call of each program: trace, lower, compile or load
        compiled = plain_jit(fun, *a, **k)
        label = getattr(fun, "__qualname__", repr(fun))

        class First:
            def __call__(self, *x, **y):
                out = compiled(*x, **y)
                if label not in marks:
                    jax.block_until_ready(out)
                    marks[f"{label} first call"] = time.perf_counter() - began
                return out

            def __getattr__(self, attr):
                return getattr(compiled, attr)
        return First()
    jax.jit = jit
    from jaxdp.train import main
    code = main(train_args)
    marks["end"] = time.perf_counter() - began
    for label, at in sorted(marks.items(), key=lambda kv: kv[1]):
        print(f"{at:7.3f} s  {label}", flush=True)
    if code:
        raise SystemExit(code)
    return marks


def select(densities: list[float], chunks: list[int], repeats: int) -> dict:
    """Median ms of choosing each chunk's k largest |x| (the top-k codec's selection) over a buffer of
    GPT-2 small's gradient size, one device: jax.lax.top_k and jax.lax.approx_max_k (recall 0.95) at
    each chunk length and density."""
    import jax
    import jax.numpy as jnp

    size = 1_000_000 if os.environ.get("GPU_SMALL") else 163_159_680
    flat = jax.random.normal(jax.random.PRNGKey(0), (size,), jnp.float32)
    out = {"device": jax.devices()[0].device_kind, "values": size, "select": []}
    for chunk in chunks:
        rows = -(-size // chunk)
        x = jnp.pad(flat, (0, rows * chunk - size)).reshape(rows, chunk)
        for density in densities:
            k = max(1, round(density * chunk))
            for how, fn in (("top_k", lambda a, k=k: jax.lax.top_k(jnp.abs(a), k)[1]),
                            ("approx_max_k", lambda a, k=k: jax.lax.approx_max_k(jnp.abs(a), k, recall_target=0.95)[1])):
                f = jax.jit(fn)
                try:
                    jax.block_until_ready(f(x))
                except Exception as err:  # (a form a backend lacks)
                    print(f"chunk {chunk:5d} k {k:4d} {how:12s} failed: {str(err).splitlines()[0][:100]}", flush=True)
                    continue
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    jax.block_until_ready(f(x))
                    times.append(time.perf_counter() - t)
                ms = 1e3 * statistics.median(times)
                out["select"].append({"chunk": chunk, "density": density, "k": k, "how": how, "ms": ms})
                print(f"chunk {chunk:5d} k {k:4d} {how:12s} {ms:8.2f} ms", flush=True)
    return out


def muon(precisions: list[str], repeats: int) -> dict:
    """Median ms of one optimizer update on GPT-2 small's parameters (random gradients), one device:
    AdamW, then --optimizer muon (Muon on the hidden matrices, Adam elsewhere) with its Newton-Schulz
    products traced under each of `precisions` (jax.default_matmul_precision), then optax.contrib.muon
    itself (one Newton-Schulz per parameter) under each, and how far each one's Muon updates are from
    those of the first (relative Frobenius norm, largest leaf)."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxdp.models.builtin import GPT
    from jaxdp.step import optim

    small = {"vocab_size": 512, "seq_len": 64, "layers": 2, "d_model": 64, "heads": 2} if os.environ.get("GPU_SMALL") else {}
    model = GPT(dtype=jnp.bfloat16, **small)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, model.seq_len), jnp.int32))["params"]
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.PRNGKey(1), 2 * len(leaves))
    params = jax.tree.unflatten(tree, [jax.random.normal(k, s.shape, jnp.float32) * 0.02 for k, s in zip(keys, leaves)])
    grads = jax.tree.unflatten(tree, [jax.random.normal(k, s.shape, jnp.float32) * 1e-3
                                      for k, s in zip(keys[len(leaves):], leaves)])
    out = {"device": jax.devices()[0].device_kind, "values": sum(s.size for s in leaves), "updates": {}}
    reference = None
    runs = [("adamw", "default", optim.adamw(1e-3, 0.9, 0.1))]
    runs += [("muon", p, optim.muon(1e-3, 0.9, 0.0, on="hidden")) for p in precisions]
    # optax's own muon, one Newton-Schulz per parameter (jaxdp's batches them by shape: jaxdp/step/optim.py, batched_muon)
    runs += [("optax-muon", p, optax.contrib.muon(1e-3, muon_weight_dimension_numbers=optim.hidden_matrices))
             for p in precisions]
    for name, precision, tx in runs:
        state = tx.init(params)
        with jax.default_matmul_precision(None if precision == "default" else precision):
            update = jax.jit(lambda g, s, p, tx=tx: tx.update(g, s, p)[0]).lower(grads, state, params).compile()
        result = jax.block_until_ready(update(grads, state, params))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(update(grads, state, params))
            times.append(time.perf_counter() - t)
        row = {"ms": 1e3 * statistics.median(times)}
        if name.endswith("muon"):
            if reference is None:
                reference = result
            row["max_rel_diff"] = max(float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30))
                                      for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(reference)))
        out["updates"][f"{name} {precision}"] = row
        print(f"{name:10s} {precision:16s} {row['ms']:8.2f} ms  {row.get('max_rel_diff', '')}", flush=True)
    return out


def kernels(tokens: int, width: int, vocab: int, repeats: int, json_path: str | None = None) -> dict:
    """jaxdp/models/kernels.py and fp8.py on the card, forward and backward, each against its XLA
    path at GPT-2 small's shapes: LayerNorm over (tokens, width), the loss over (tokens, vocab) bf16
    logits, and the blocks' four products on fp8 against bf16. Median ms of `repeats` calls, the
    largest relative difference of the results, and whether the compiled fp8 product holds an fp8
    matrix product (cuBLASLt's f8 custom call). A case that fails to compile is reported, not fatal."""
    import jax
    import jax.numpy as jnp

    from jaxdp.models import fp8
    from jaxdp.models import kernels as K
    from jaxdp.models.tasks import token_cross_entropy

    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    x = (jax.random.normal(keys[0], (16, tokens // 16, width)) * 2 + 0.5).astype(jnp.bfloat16)
    scale = 1 + 0.1 * jax.random.normal(keys[1], (width,))
    bias = 0.1 * jax.random.normal(keys[2], (width,))
    logits = (jax.random.normal(keys[3], (tokens, vocab)) * 3).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[4], (tokens,), 0, vocab)
    out = {"device": jax.devices()[0].device_kind, "tokens": tokens, "width": width, "vocab": vocab, "cases": {}}

    def timed(name, f, *args, reference=None):  # every array an argument: a captured one is a constant XLA folds
        row = {}
        try:
            step = jax.jit(f)
            result = jax.block_until_ready(step(*args))
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                jax.block_until_ready(step(*args))
                times.append(time.perf_counter() - t)
            row["ms"] = 1e3 * statistics.median(times)
            if reference is not None:
                row["max_rel_diff"] = max(float(jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32))
                                                / (jnp.linalg.norm(b.astype(jnp.float32)) + 1e-30))
                                          for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(reference)))
        except Exception as err:  # noqa: BLE001 - a kernel that does not lower is a figure too
            row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
            result = None
        out["cases"][name] = row
        print(f"{name:28s} {row}", flush=True)
        if json_path:  # what was measured survives a stage's time limit
            with open(json_path, "w") as f:
                json.dump(out, f, indent=1)
        return result

    ln_cot = jax.random.normal(keys[5], x.shape).astype(jnp.bfloat16)
    ref = None
    for path in ("xla", "pallas"):
        def ln(x, s, b, cot, path=path):
            y, pull = jax.vjp(lambda x, s, b: K.layer_norm(x, s, b, 1e-5, path), x, s, b)
            return y, pull(cot)
        ref = timed(f"layer_norm {path}", ln, x, scale, bias, ln_cot, reference=None if path == "xla" else ref)
    ce_cot = jax.random.uniform(keys[6], (tokens,))
    for path in ("xla", "pallas"):
        def ce(z, labels, cot, path=path):
            f = token_cross_entropy if path == "xla" else K.cross_entropy
            y, pull = jax.vjp(lambda z: f(z, labels), z)
            return y, pull(cot)
        ref = timed(f"cross_entropy {path}", ce, logits, labels, ce_cot, reference=None if path == "xla" else ref)
    for name, (k, n) in {"qkv": (width, 3 * width), "proj": (width, width), "fc": (width, 4 * width),
                         "fc_out": (4 * width, width)}.items():
        a = jax.random.normal(keys[7], (tokens, k)).astype(jnp.bfloat16)
        w = (0.02 * jax.random.normal(keys[1], (k, n))).astype(jnp.bfloat16)
        g = jax.random.normal(keys[2], (tokens, n)).astype(jnp.bfloat16)
        for kind in ("bf16", "fp8"):
            product = (lambda a, w: a @ w) if kind == "bf16" else fp8.matmul
            def run(a, w, g, product=product):
                y, pull = jax.vjp(product, a, w)
                return y, pull(g)
            ref = timed(f"{name} {kind}", run, a, w, g, reference=None if kind == "bf16" else ref)
        try:
            text = jax.jit(fp8.matmul).lower(a, w).compile().as_text()
            out["cases"][f"{name} fp8"]["f8_gemm"] = "f8" in text and "cublas" in text
        except Exception as err:  # noqa: BLE001
            out["cases"][f"{name} fp8"]["f8_gemm"] = f"{type(err).__name__}"
    return out


def embed(tokens: int, width: int, vocab: int, repeats: int) -> dict:
    """The GPT's token lookup and its gradient alone, on text (the Python standard library's bytes:
    a few hundred distinct ids, so many tokens add into the same rows) and on uniform ids: the rows
    looked up in a bf16 copy of the table (flax's nn.Embed(dtype=bf16): a bf16 scatter-add) against
    the float32 table's rows cast (jaxdp's GPT: a float32 scatter-add). Median ms of `repeats` calls."""
    import glob
    import sysconfig

    import jax
    import jax.numpy as jnp
    import numpy as np

    text = b"".join(open(f, "rb").read() for f in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:50])
    ids = {"text": jnp.asarray(np.frombuffer(text, np.uint8)[:tokens].astype(np.int32)),
           "uniform": jax.random.randint(jax.random.PRNGKey(0), (tokens,), 0, vocab)}
    table = jax.random.normal(jax.random.PRNGKey(1), (vocab, width)) * 0.02
    cot = jax.random.normal(jax.random.PRNGKey(2), (tokens, width)).astype(jnp.bfloat16)
    out = {"device": jax.devices()[0].device_kind, "tokens": tokens, "width": width, "vocab": vocab, "cases": {}}
    forms = {"bf16 table": lambda t, i: jnp.take(t.astype(jnp.bfloat16), i, axis=0),
             "float32 table": lambda t, i: jnp.take(t, i, axis=0).astype(jnp.bfloat16)}
    for data, i in ids.items():
        for form, f in forms.items():
            grad = jax.jit(lambda t, i=i, f=f: jax.vjp(lambda t: f(t, i), t)[1](cot)[0])
            jax.block_until_ready(grad(table))
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                jax.block_until_ready(grad(table))
                times.append(time.perf_counter() - t)
            out["cases"][f"{data}, {form}"] = 1e3 * statistics.median(times)
            print(f"{data:8s} {form:14s} {out['cases'][f'{data}, {form}']:8.3f} ms", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="docs/perf/gpu_tools.py")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("trace")
    p.add_argument("out")
    p.add_argument("--skip", type=int, default=10, help="steps before the trace starts")
    p = sub.add_parser("summarize")
    p.add_argument("out")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--json")
    for name in ("ce", "embed", "kernels"):  # GPT-2 small's shapes: tokens of a batch of 16, width, vocabulary
        p = sub.add_parser(name)
        p.add_argument("--tokens", type=int, default=16 * 1024)
        p.add_argument("--width", type=int, default=768)
        p.add_argument("--vocab", type=int, default=50304)
        p.add_argument("--repeats", type=int, default=20)
        if name != "ce":
            p.add_argument("--json")
    p = sub.add_parser("sample")
    p.add_argument("checkpoint_dir")
    p.add_argument("hf_dir")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    p = sub.add_parser("variants")
    p.add_argument("specs", help="variants separated by ';', each XLA options name=value ('default': none)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=600.0, help="compile no further variant after this long")
    p.add_argument("--json")
    p = sub.add_parser("codecs")
    p.add_argument("names", help="codecs separated by ';' (jaxdp.sync.codecs.parse)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json")
    p = sub.add_parser("select")
    p.add_argument("--densities", default="0.01,0.001")
    p.add_argument("--chunks", default="4096,1024,256")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json")
    p = sub.add_parser("muon")
    p.add_argument("--precisions", default="highest;default;BF16_BF16_F32",
                   help="jax.default_matmul_precision values separated by ';' (the first is the reference)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json")
    p = sub.add_parser("startup")
    p.add_argument("--json")
    argv = sys.argv[1:]
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []  # trace: the command line's flags
    args = parser.parse_args(argv[:len(argv) - len(train_args) - (1 if "--" in argv else 0)])
    if args.command == "trace":
        trace(args.out, train_args, args.skip)
    elif args.command == "summarize":
        s = summarize(args.out, args.steps)
        print_summary(s)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(s, f, indent=1)
    elif args.command == "variants":
        s = variants([v.strip() for v in args.specs.split(";") if v.strip()], args.batch, args.steps, args.repeats,
                     args.budget_s)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(s, f, indent=1)
    elif args.command in ("codecs", "startup"):
        s = codecs([v.strip() for v in args.names.split(";") if v.strip()], args.repeats) if args.command == "codecs" \
            else startup(train_args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(s, f, indent=1)
    elif args.command == "select":
        s = select([float(v) for v in args.densities.split(",")], [int(v) for v in args.chunks.split(",")], args.repeats)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(s, f, indent=1)
    elif args.command == "muon":
        s = muon([v.strip() for v in args.precisions.split(";") if v.strip()], args.repeats)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(s, f, indent=1)
    elif args.command in ("kernels", "embed"):
        s = kernels(args.tokens, args.width, args.vocab, args.repeats, args.json) if args.command == "kernels" \
            else embed(args.tokens, args.width, args.vocab, args.repeats)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(s, f, indent=1)
    elif args.command == "ce":
        print(json.dumps(cross_entropy(args.tokens, args.width, args.vocab, args.repeats)))
    else:
        s = sample(args.checkpoint_dir, args.hf_dir, args.new_tokens, args.repeats)
        print(json.dumps(s))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(s, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
