"""plan: predicted step time on a described cluster, from the cost model (jaxdp/sync/costmodel.py), and
that model checked against the slow-network testbed.

    python -m jaxdp.bench plan --nodes 4 --devices-per-node 8 --link 10gbit --latency 50us --compute-ms 120 \\
        --train-args "--model gpt --layers 12 --d-model 768 --heads 12 --seq-len 1024"
    python -m jaxdp.bench plan --nodes 2 --link 100mbit                       # the default MLP, compute measured here
    python -m jaxdp.bench plan --validate --rate 100mbit \\
        --variants "--strategy ring;--strategy ring --compression int8;--strategy ring --compression int4"

Prediction: every candidate of the controller's ladder (none, bf16, int8 and int4 on a ring,
PowerSGD ranks), synchronous and with local steps (--sync-every 4, 16, with and without --overlap),
flat and (several devices per node) hierarchical: the all-reduce time of `predict.Cluster`
(a bandwidth-optimal ring: 2 (P - 1) / P of the payload over each node's link, 2 (P - 1)
messages of --latency) and the step it makes with the compute time (`costmodel.predicted_step_s`:
compute plus the per-step share of one average, or the longer of the two with --overlap). The
compute time is --compute-ms, or measured here: one device training the model of --train-args on
its share of the batch (the median of the run's log intervals). It also says what `--sync-every
auto --compression auto` would choose there (with and without --overlap) and why, from the same
functions the controller calls on measured figures.

Validation (--validate, root and iproute2): each variant trains twice on the testbed, 2 processes,
unshaped and at --rate, in one invocation. The unshaped run's step time stands for the compute (its
link is a veth); the prediction at --rate adds the bytes each device sent per step, as the run
counts them, over the rate (or takes the longer of the two with --overlap), and is set against
the measured one: the table gives both and the error.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import re
import shlex
import statistics
import sys
import warnings
from typing import Any

from jaxdp.bench.report import print_table, write_json

_TIMES = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="predicted step time on a described cluster (N nodes x G devices, link "
                                           "speeds) from the cost model; --validate checks it on the testbed")
    p.add_argument("--nodes", type=int, default=2, help="nodes (processes on CPU hosts)")
    p.add_argument("--devices-per-node", type=int, default=1)
    p.add_argument("--link", default="100mbit", help="each node's link, each way: 10mbit, 1gbit, 100gbit ...")
    p.add_argument("--latency", default="0s", help="per message on the link: 50us, 1ms ...")
    p.add_argument("--local-link", default=None, help="between devices of a node (default: free beside the link)")
    p.add_argument("--compute-ms", type=float, help="one device's step (forward, backward) at its share of the batch; "
                                                    "default: measured here")
    p.add_argument("--strategy", choices=("psum", "ring"), default="ring")
    p.add_argument("--comm-target", type=float, default=None, help="the controller's target (default: its own)")
    p.add_argument("--train-args", default="", help="the model: jaxdp.train flags (--model, --batch-size ...)")
    p.add_argument("--top", type=int, default=12, help="rows to print, fastest first (the JSON has all)")
    p.add_argument("--validate", action="store_true", help="check the model on the testbed (root, iproute2)")
    p.add_argument("--rate", default="100mbit", help="--validate: the shaped link's rate")
    p.add_argument("--variants", type=lambda t: [v.strip() for v in t.split(";")],
                   default=["--strategy ring", "--strategy ring --compression bf16", "--strategy ring --compression int8",
                            "--strategy ring --compression int4"],
                   help="--validate: ';'-separated jaxdp.train variants")
    p.add_argument("--steps", type=int, default=400, help="--validate: steps per run")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--timeout", type=float, default=600, help="--validate: seconds per run")
    p.add_argument("--json")
    p.set_defaults(run=run)


def bits_per_s(text: str) -> int:
    """tc's rate syntax (testbed.parse_rate), its error as one line."""
    from jaxdp.bench import testbed

    try:
        return testbed.parse_rate(text)
    except testbed.TestbedError as err:
        raise refuse(str(err)) from None


def seconds(text: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(us|ms|s)\s*", str(text).lower())
    if not match:
        raise refuse(f"{text!r} is not a time like 0s, 50us or 1ms")
    return float(match.group(1)) * _TIMES[match.group(2)]


def refuse(message: str) -> SystemExit:
    """Bad input to plan: `message` as one line on stderr, then exit 2 (raise what this returns)."""
    from jaxdp.errors import EXIT_BAD_INPUT

    print(f"jaxdp.bench plan: error: {message}", file=sys.stderr)
    return SystemExit(EXIT_BAD_INPUT)


def check_numbers(args: argparse.Namespace) -> None:
    """The prediction's numbers must mean something: a compute time and a target above 0 and finite
    (0 ms of compute makes every all-reduce infinitely slow by comparison), a row or more, and
    --train-args that split as a shell would."""
    for flag, value in (("--compute-ms", args.compute_ms), ("--comm-target", args.comm_target)):
        if value is not None and not (math.isfinite(value) and value > 0):
            what = "one device's milliseconds per step" if flag == "--compute-ms" else \
                "the largest all-reduce time as a fraction of the compute time, e.g. 0.25"
            raise refuse(f"{flag} must be a finite number above 0 ({what}), got {value:g}")
    if args.top < 1:
        raise refuse(f"--top must be 1 or more (rows to print), got {args.top}")
    try:
        shlex.split(args.train_args)
    except ValueError as err:
        raise refuse(f"--train-args {args.train_args!r} does not split as a shell command line ({err}); "
                     f"check its quotes") from None


def run(args: argparse.Namespace) -> list[dict]:
    if args.validate:
        return validate(args)
    if args.nodes < 1 or args.devices_per_node < 1:
        raise refuse("--nodes and --devices-per-node must be 1 or more")
    check_numbers(args)
    from jaxdp.sync import costmodel, predict

    cluster = predict.Cluster(args.nodes, args.devices_per_node, bits_per_s(args.link), seconds(args.latency),
                                bits_per_s(args.local_link) if args.local_link else math.inf)
    compute_s, params, measured = model_and_compute(args, args.nodes * args.devices_per_node)
    rows = predict.predict(cluster, compute_s, params, strategy=args.strategy)
    base = next(r["step_s"] for r in rows if (r["compression"], r["sync_every"], r["hierarchy"]) == ("none", 1, "flat"))
    for row in rows:
        row["steps_per_s"], row["vs_plain"] = 1 / row["step_s"], base / row["step_s"]
    # fastest first; among equals the fewest local steps, no overlap, then the ladder's order (least compression)
    rows.sort(key=lambda r: (round(r["step_s"], 9), r["sync_every"], r["overlap"]))
    print(f"{args.nodes} node{'s' if args.nodes > 1 else ''} x {args.devices_per_node} device"
          f"{'s' if args.devices_per_node > 1 else ''}, {args.link} per node, {args.latency} per message, "
          f"--strategy {args.strategy}; compute {compute_s * 1e3:.3g} ms per step ({measured}); "
          f"{costmodel.uncompressed_bytes(params) / 1e6:.3g} MB of gradients")
    shown = [{**r, "overlap": "yes" if r["overlap"] else ""} for r in rows[:args.top]]
    print_table(shown, [("compression", "compression", "s"), ("sync_every", "H", "d"), ("overlap", "overlap", "s"),
                                  ("hierarchy", "hierarchy", "s"), ("allreduce_s", "all-reduce s", ".3g"),
                                  ("step_s", "step s", ".3g"), ("steps_per_s", "steps/s", ".3g"),
                                  ("vs_plain", "vs plain", ".2f")])
    choices = [auto_choice(cluster, compute_s, params, args.strategy, overlap, args.comm_target) for overlap in (False, True)]
    for choice in choices:
        print(f"--sync-every auto --compression auto{' --overlap' if choice['overlap_flag'] else ''}: "
              f"{choice['summary']} (predicted {choice['step_s'] * 1e3:.3g} ms per step, "
              f"{base / choice['step_s']:.2f}x plain synchronous)")
        faster = sum(r["step_s"] < choice["step_s"] * (1 - 1e-9) and (r["overlap"] == "yes") <= choice["overlap_flag"]
                     for r in shown)
        if faster:
            print(f"  {faster} row(s) above are faster: auto does not take the fastest row but the fewest local steps, "
                  f"then the least compression, whose predicted all-reduce fits --comm-target (a fraction of the "
                  f"compute), since each local step and each bit of compression costs some quality")
    write_json(args.json, rows, cluster=vars(cluster), compute_s=compute_s, compute_from=measured, auto=choices,
               strategy=args.strategy)
    return rows


def model_and_compute(args: argparse.Namespace, devices: int) -> tuple[float, Any, str]:
    """(seconds per step of one device at its share of the batch, the abstract params, where the
    time came from). With --compute-ms the params are the model's shapes alone (a GPT with no
    --dataset: bytes, or --vocab-size tokens); otherwise the model of --train-args trains on one
    device here for a few seconds, and the median of its log intervals is the time."""
    import jax

    from jaxdp.config import parse_args
    from jaxdp.train import train

    from jaxdp.config import ConfigError

    flags = shlex.split(args.train_args)
    no_data = False
    try:
        config = parse_args(flags)
    except ConfigError as err:
        if "--dataset" in flags or "token stream" not in str(err):
            raise refuse(f"--train-args: {err}") from None
        config, no_data = parse_args([*flags, "--dataset", "bytes.txt"]), True  # a token model, sized for bytes
    if no_data and args.compute_ms is None:
        raise refuse("measuring the compute trains the model: give --train-args a --dataset, or give --compute-ms")
    if config.batch_size % devices:
        raise refuse(f"--batch-size={config.batch_size} (of --train-args) must be divisible by the {devices} devices")
    if args.compute_ms is not None:
        return args.compute_ms / 1e3, abstract_params(config, no_data), "--compute-ms"
    share = ["--batch-size", str(config.batch_size // devices)]
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():  # its summary is not this table's
        warnings.simplefilter("ignore")  # (one device: "nothing to synchronise")
        result = train(parse_args([*flags, *share, "--devices", "1", "--steps", "60", "--log-every", "10",
                                   "--eval-every", "0", "--no-progress"]))
    rates = [r["steps_per_sec"] for r in result.history if isinstance(r.get("steps_per_sec"), (int, float))]
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), result.state.params)
    return 1 / statistics.median(rates), params, f"measured here: one device, batch {config.batch_size // devices}"


def abstract_params(config: Any, no_data: bool = False) -> Any:
    """The shapes of the params --model would train, without compilation; `no_data`: a token model
    whose --dataset was not given, sized for bytes (256 tokens) or --vocab-size."""
    import jax
    import jax.numpy as jnp

    from jaxdp.data import datasets as data
    from jaxdp.models import usermodel

    tokens = no_data or config.dataset.endswith((".txt", ".bin", ".npy"))
    if no_data:
        outputs, example = config.vocab_size or 256, jnp.zeros((1, config.seq_len), jnp.int32)
    else:
        dataset = data.load_dataset(config.dataset, seq_len=config.seq_len, vocab_size=config.vocab_size,
                                    tokenizer=config.tokenizer)
        outputs = dataset.vocab_size if dataset.kind == "tokens" else dataset.num_classes
        example = dataset.example()
    model = usermodel.build(config, outputs, None, "tokens" if tokens else "classification")
    return jax.eval_shape(model.init, usermodel.init_rngs(0), example)["params"]


def auto_choice(cluster: Any, compute_s: float, params: Any, strategy: str, overlap: bool,
                target: float | None) -> dict[str, Any]:
    """What `--sync-every auto --compression auto` (with `overlap`: and --overlap) chooses on
    `cluster`: the controller's own rules (costmodel.plan, then costmodel.choose_local_steps) on
    the figures the cluster's all-reduce model gives, flat."""
    from jaxdp.sync import codecs as codec_table, costmodel

    fraction = costmodel.TARGET_COMM_FRACTION if target is None else target
    model = cluster.allreduce()
    devices = cluster.nodes * cluster.devices
    candidates = costmodel.ladder(params, quantized_devices=devices if strategy == "ring" else None, devices=devices)
    full = costmodel.uncompressed_bytes(params)
    sizes = [max(full // 16, 1 << 12), max(full, 1 << 16)]
    figures = {"compute_s": compute_s, "comm_small_s": model.seconds(sizes[0]), "comm_full_s": model.seconds(sizes[1]),
               "comm_sizes": sizes}
    codec, reasons = costmodel.plan(compute_s, costmodel.comm_model(figures), params, candidates, fraction)
    if reasons["fits"] or devices == 1:
        step = costmodel.predicted_step_s(compute_s, reasons["predicted_s"][codec.name], 1)
        guard = " (the quality guard then checks it on the run's gradients and may step back)" \
            if codec_table.row(codec.name).guarded else ""
        return {"overlap_flag": overlap, "compression": codec.name, "sync_every": 1, "overlap": False, "step_s": step,
                "summary": f"synchronous, --compression {codec.name}{guard}: {reasons['why']}"}
    allowed = [c for c in candidates if costmodel.pseudo_gradient_codec(c)]
    from jaxdp.sync.rules import abilities

    sparse = costmodel.pseudo_topk(params, devices, abilities(strategy))
    record = costmodel.choose_local_steps(figures, costmodel.options(allowed + sparse, params), fraction, overlap,
                                          [c.name for c in sparse])
    summary = (f"--sync-every {record['sync_every']}, pseudo-gradient {record['pseudo_gradient']}"
               f"{', overlapped' if record['overlap'] else ''}: {record['why']}")
    if record["pseudo_gradient"] in {c.name for c in sparse}:  # what DiLoCo's outer momentum gets instead
        dense = costmodel.choose_local_steps(figures, costmodel.options(allowed, params), fraction, overlap)
        summary += (f" with --outer-optimizer sgd --outer-lr 1 --outer-momentum 0 (the quality guard then checks "
                    f"it on the run's gradients and may step back); with an outer momentum (DiLoCo's Nesterov): "
                    f"--sync-every {dense['sync_every']}, pseudo-gradient {dense['pseudo_gradient']}")
    return {"overlap_flag": overlap, "compression": record["pseudo_gradient"], "sync_every": record["sync_every"],
            "overlap": record["overlap"], "step_s": record["predicted_step_s"], "summary": summary}


def testbed_step_s(compute_s: float, sync_bytes: float, sync_every: int, bits_per_s: float, burst: float,
                   overlap: bool = False, bucket: bool = True) -> float:
    """Predicted seconds per step on the testbed's shaped link: `compute_s` per step, `sync_bytes`
    sent by each device per average, one average every `sync_every` steps.

    `bucket=False` is the cost model's own rule (costmodel.predicted_step_s): the bytes take
    bytes / rate after the compute, or with `overlap` the longer of the two. A real link with no
    spare buffer behaves so. The testbed's token bucket (`burst` bytes, testbed.burst_bytes)
    refills while the processes compute: an average's first min(burst, the refill over its H
    steps) bytes pass at once, and only the rest waits on the rate (`bucket=True`)."""
    link = sync_bytes * 8 / bits_per_s
    if overlap and sync_every > 1:
        return max(compute_s, link / sync_every)
    if not bucket:
        return compute_s + link / sync_every
    free = min(burst, sync_every * compute_s * bits_per_s / 8)
    return compute_s + max(0.0, sync_bytes - free) * 8 / bits_per_s / sync_every


def validate(args: argparse.Namespace) -> list[dict]:
    """Each variant unshaped and at --rate on the testbed; the shaped step predicted from the
    unshaped one and the bytes sent, against the measured one."""
    from jaxdp.bench import testbed
    from jaxdp.bench.variants import measure

    testbed.require("plan --validate")
    rate = testbed.parse_rate(args.rate)
    flags = ["--steps", str(args.steps), "--log-every", str(args.log_every)]
    measured: dict[tuple[str, str], dict] = {}
    for link in ("unshaped", args.rate):
        with testbed.Testbed(num_hosts=2, rate=None if link == "unshaped" else args.rate) as bed:
            for variant in args.variants:
                measured[link, variant] = measure(bed, flags, variant, timeout=args.timeout,
                                                  what=f"plan --validate at {link}")
    rows = []
    for variant in args.variants:
        unshaped, shaped = measured["unshaped", variant], measured[args.rate, variant]
        words = shlex.split(variant)
        sync_every = int(words[words.index("--sync-every") + 1]) if "--sync-every" in words else 1
        compute, overlap = 1 / unshaped["steps_per_s"], "--overlap" in words
        sent = shaped["comm_bytes"] or 0  # what each device sends per average (local steps: once every H steps)
        plain, bucket = (testbed_step_s(compute, sent, sync_every, rate, testbed.burst_bytes(rate), overlap, b)
                         for b in (False, True))
        rows.append({"variant": variant, "unshaped_steps_per_s": unshaped["steps_per_s"],
                     "bytes_per_sync": sent, "sync_every": sync_every,
                     "predicted_steps_per_s": 1 / plain, "bucket_steps_per_s": 1 / bucket,
                     "measured_steps_per_s": shaped["steps_per_s"],
                     "error": (1 / plain) / shaped["steps_per_s"] - 1,
                     "bucket_error": (1 / bucket) / shaped["steps_per_s"] - 1})
    print(f"2 processes in 2 network namespaces, unshaped and at {args.rate}; median steps/s of one run each. "
          f"Predicted at {args.rate} from the unshaped step and the bytes sent: the cost model's rule (compute + bytes / "
          f"rate per step; --overlap: the longer), and the same with the testbed's token bucket "
          f"({testbed.burst_bytes(rate)} bytes, refilled while computing)")
    print_table(rows, [("variant", "variant", "s"), ("unshaped_steps_per_s", "unshaped steps/s", ".1f"),
                       ("bytes_per_sync", "bytes per average", ".0f"), ("sync_every", "H", "d"),
                       ("measured_steps_per_s", "measured", ".1f"), ("predicted_steps_per_s", "cost model", ".1f"),
                       ("error", "error", "+.0%"), ("bucket_steps_per_s", "with the bucket", ".1f"),
                       ("bucket_error", "error", "+.0%")])
    for key, name in (("error", "cost model"), ("bucket_error", "with the bucket")):
        errors = [abs(r[key]) for r in rows]
        print(f"{name}: median |error| {statistics.median(errors):.0%}, largest {max(errors):.0%}")
    write_json(args.json, rows, rate=args.rate, steps=args.steps, burst_bytes=testbed.burst_bytes(rate))
    return rows
