"""goodput: a 2-process run under `python -m jaxdp.launch --max-restarts`, with a random worker
killed (SIGKILL) every `--kill-every` seconds once it trains (the first `--kill-every` after its first logged
step), against the same run undisturbed; `--load N` runs N busy loops beside both.

    python -m jaxdp.bench goodput                                  # a kill every 10 s
    python -m jaxdp.bench goodput --kill-every 10 --steps 6000 --save-every 100 --json g.json

Both runs are `python -m jaxdp.launch --nproc-per-node 2 [--max-restarts 1000] -- python -m
jaxdp.train --devices 1 --steps N --checkpoint-dir D --save-every K` (the default MLP, one core
per process, the persistent compilation cache shared, so every restart finds its programs
compiled). Goodput = undisturbed wall time / disturbed wall time for the same steps; the time lost
per kill is the difference divided by the kills. The final parameters of the two runs are compared
through the checksums every checkpoint records (jaxdp/checkpoint/checkpointer.py): a restarted run resumes
exactly, so they must be equal.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from jaxdp.bench.report import print_table, write_json

# = jaxdp.checkpoint.checkpointer.CHECKSUMS_FILE (not imported: the benchmark parser imports no JAX)
CHECKSUMS_FILE = "jaxdp_checksums.json"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("goodput", help="a random training process killed every N s under the launcher's restarts, "
                                              "against the same run undisturbed")
    p.add_argument("--kill-every", type=float, default=10.0, help="seconds between kills")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--save-every", default="100", help="steps, or auto (jaxdp/checkpoint/saveplan.py: chosen from the measured save "
                   "cost and, after a restart, the failures seen)")
    p.add_argument("--train-args", default="", help="more jaxdp.train flags, as one string")
    p.add_argument("--seed", type=int, default=0, help="of the choice of worker to kill (repeat i: seed + i)")
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs, undisturbed then with kills, one after the "
                   "other; the summary row is the median of the pairs' goodputs (this machine's run-to-run spread is "
                   "about as large as what the kills cost)")
    p.add_argument("--elastic", action="store_true", help="`jaxdp.launch --elastic` (--strategy host): a lost process "
                   "restarts alone; the plain run's undisturbed time is measured too")
    p.add_argument("--elastic-engine", choices=("hub", "torchft"), default="hub", help="with --elastic: the launcher's "
                   "engine (torchft: pip install 'jaxdp-trainer[elastic]'; jaxdp/elastic/ft.py)")
    p.add_argument("--launch-args", default="", help="more jaxdp.launch flags of the elastic runs, as one string "
                   "(e.g. --heartbeat-timeout 0.5)")
    p.add_argument("--load", type=int, default=0, help="busy-loop processes run beside every run (e.g. 2 x the "
                   "cores: the machines users have are busy); 0: none")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--json")
    p.set_defaults(run=run)


class BusyLoad:
    """`count` processes that spin on the CPU (no pinning: the scheduler spreads them over the
    cores) while the block runs, so the runs measured beside them run on a busy machine."""

    def __init__(self, count: int):
        self.count, self.procs = count, []

    def __enter__(self) -> "BusyLoad":
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def _children(pid: int) -> list[int]:
    """The direct children of `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def training_processes(launcher: int) -> list[int]:
    """The training processes under a launcher: its children, and the children of an elastic
    run's zygote (jaxdp/launcher/zygote.py) instead of the zygote itself."""
    found = []
    for child in _children(launcher):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                zygote = b"jaxdp.launcher.zygote" in f.read()
        except OSError:
            continue
        found.extend(_children(child) if zygote else [child])
    return found


def _training(directory: str) -> bool:
    """The run has logged a step: its processes are past start-up and compilation."""
    try:
        with open(os.path.join(directory, "metrics.jsonl")) as f:
            return any(line.startswith('{"step": ') for line in f)
    except OSError:
        return False


def _trained(directory: str, steps: int) -> bool:
    """The run's last step is logged (what remains is the final save and evaluation)."""
    try:
        with open(os.path.join(directory, "metrics.jsonl")) as f:
            return any(f'"step": {steps},' in line for line in f)
    except OSError:
        return False


def _run(args: argparse.Namespace, directory: str, kill_every: float | None, steps: int | None = None,
         elastic: bool = False, seed: int = 0) -> dict:
    import shlex

    steps = args.steps if steps is None else steps
    engine = ["--elastic", "--elastic-engine", args.elastic_engine, *shlex.split(args.launch_args)] if elastic else []
    command = [sys.executable, "-m", "jaxdp.launch", "--nproc-per-node", "2", *engine,
               *(["--max-restarts", "1000"] if kill_every else []), "--", sys.executable, "-m", "jaxdp.train",
               "--devices", "1", "--no-progress", "--steps", str(steps), "--checkpoint-dir", directory,
               "--save-every", str(args.save_every), "--metrics-file", os.path.join(directory, "metrics.jsonl"),
               *(["--strategy", "host"] if elastic else []),
               *shlex.split(args.train_args)]
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kills: list[float] = []
    stop = threading.Event()

    def killer() -> None:
        chooser = random.Random(seed)
        while not _training(directory) and not stop.wait(0.1):  # the first kill comes kill_every after training
            pass                                                 # starts (start-up is no kill's cost)
        while not stop.wait(kill_every) and not _trained(directory, steps):  # kills while it trains
            workers = training_processes(proc.pid)
            if workers:
                victim = chooser.choice(sorted(workers))
                try:
                    os.kill(victim, signal.SIGKILL)
                    kills.append(time.perf_counter() - started)
                except ProcessLookupError:
                    pass

    lines: list[tuple[float, str]] = []  # (seconds since the start, a line of the launcher's output)

    def reader() -> None:
        for line in proc.stdout:
            lines.append((time.perf_counter() - started, line))

    thread = threading.Thread(target=killer, daemon=True) if kill_every else None
    if thread:
        thread.start()
    reading = threading.Thread(target=reader, daemon=True)
    reading.start()
    try:
        proc.wait(timeout=args.timeout)
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
        reading.join(timeout=10)
    output = "".join(line for _, line in lines)
    wall = time.perf_counter() - started
    if proc.returncode:
        raise SystemExit(f"jaxdp.bench: goodput: the run failed (exit code {proc.returncode}):\n{output[-4000:]}")
    if not os.path.exists(os.path.join(directory, str(steps), CHECKSUMS_FILE)):
        raise SystemExit(f"jaxdp.bench: goodput: the run saved no step {steps}:\n{output[-4000:]}")
    with open(os.path.join(directory, str(steps), CHECKSUMS_FILE)) as f:
        checksums = {k: v for k, v in json.load(f).items() if k.startswith("params")}
    chosen = []  # --save-every auto's intervals, in the order the (re)started processes chose them
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        chosen = [record["save_every"] for record in map(json.loads, f) if record.get("event") == "save_every"]
    return {"wall_s": wall, "kills": len(kills), "checksums": checksums, "chosen": chosen,
            "missed": missed_steps(output, steps, 2), "loadavg": os.getloadavg()[0],
            "timeline": timeline(kills, lines) if kill_every else {}}


def timeline(kills: list[float], lines: list[tuple[float, str]]) -> dict:
    """Where each kill's time went, from the launcher's and the workers' timestamped lines: `detect_s`,
    the kill to the first line that leaves a rank out (the survivors stop waiting for it); `restart_s`,
    the kill to the launcher's restart; `back_s`, the kill to the restarted worker's heal (its state
    taken from a live one; the rest is its start-up and compilation); medians over the kills. And
    `left_out`, every line that left a rank out, against `kills`: more than the kills are left-outs
    of live workers (a late heartbeat on a busy machine), each a needless heal."""
    import statistics

    def after(at: float, pattern: str) -> float | None:
        return next((t - at for t, line in lines if t >= at and re.search(pattern, line)), None)

    figures: dict[str, Any] = {"left_out": sum(1 for _, line in lines if "left out [" in line)}
    for key, pattern in (("detect_s", r"left out \["), ("restart_s", r"restarting it alone"),
                         ("back_s", r"healed from|joined the run at")):
        found = [d for d in (after(k, pattern) for k in kills) if d is not None]
        figures[key] = statistics.median(found) if found else None
    return figures


def missed_steps(output: str, steps: int, size: int) -> int:
    """Worker-steps an elastic run of local steps did not train: from the lines of the lowest live rank
    ("step S: live ranks [...]", said at each round's end where the members change), the ranks absent
    from each stretch of rounds times its steps (jaxdp/elastic/rounds.py: a lost worker's
    rounds are not redone). Every-step runs say the same lines, but their lost shards are computed by
    the survivors: the caller counts this for local steps only."""
    changes = [(int(m.group(1)), len([r for r in m.group(2).split(",") if r.strip()]))
               for m in re.finditer(r"step (\d+): live ranks \[([\d, ]*)\]", output)]
    missed, (at, live) = 0, (0, size)
    for step, now in changes + [(steps, size)]:
        missed += (size - live) * max(0, min(step, steps) - at)
        at, live = max(at, min(step, steps)), now
    return missed


def _rounds(train_args: str) -> bool:
    """Whether the run takes local steps (--sync-every N > 1)."""
    found = re.search(r"--sync-every[= ](\d+)", train_args)
    return bool(found) and int(found.group(1)) > 1


def _pair(args: argparse.Namespace, scratch: str, repeat: int, plain: dict | None) -> dict:
    """One undisturbed run and one with kills (seed + repeat), as a row."""
    calm = _run(args, os.path.join(scratch, f"calm-{repeat}"), None, elastic=args.elastic)
    killed = _run(args, os.path.join(scratch, f"killed-{repeat}"), args.kill_every, elastic=args.elastic,
                  seed=args.seed + repeat)
    done = 1 - killed["missed"] / (2 * args.steps)  # (local steps: the worker-steps trained, of all)
    row = {"mode": f"elastic ({args.elastic_engine})" if args.elastic else "restart all", "repeat": repeat,
           "seed": args.seed + repeat, "steps": args.steps, "save_every": args.save_every,
           "kill_every_s": args.kill_every, "load": args.load, "loadavg_1min": killed["loadavg"],
           "undisturbed_s": calm["wall_s"], "disturbed_s": killed["wall_s"], "kills": killed["kills"],
           "goodput": calm["wall_s"] / killed["wall_s"],
           "lost_per_kill_s": (killed["wall_s"] - calm["wall_s"]) / killed["kills"] if killed["kills"] else None,
           "same_final_params": calm["checksums"] == killed["checksums"] and bool(calm["checksums"]),
           **killed["timeline"],
           **({"examples_done": done, "goodput_examples": calm["wall_s"] / killed["wall_s"] * done}
              if _rounds(args.train_args) and args.elastic else {}),
           **({"auto_undisturbed": calm["chosen"], "auto_with_kills": killed["chosen"]} if args.save_every == "auto" else {})}
    if plain is not None:  # what the elastic mode costs when nothing fails, and goodput against the plain run
        row.update(plain_undisturbed_s=plain["wall_s"], goodput_vs_plain=plain["wall_s"] / killed["wall_s"])
    return row


def median_row(rows: list[dict]) -> dict:
    """The pairs' medians: of every figure, each over the pairs (the goodput is the median of the pairs'
    goodputs, not a ratio of medians); the final parameters equal only where every pair's did."""
    import statistics

    row = {"mode": rows[0]["mode"], "repeat": "median", "steps": rows[0]["steps"], "save_every": rows[0]["save_every"],
           "kill_every_s": rows[0]["kill_every_s"], "same_final_params": all(r["same_final_params"] for r in rows)}
    for key in ("undisturbed_s", "disturbed_s", "kills", "goodput", "lost_per_kill_s", "detect_s", "restart_s",
                "back_s", "left_out", "examples_done",
                "goodput_examples", "plain_undisturbed_s", "goodput_vs_plain"):
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            row[key] = statistics.median(values)
    return row


def run(args: argparse.Namespace) -> list[dict]:
    if args.kill_every <= 0:
        raise SystemExit(f"jaxdp.bench: goodput: --kill-every must be a positive number of seconds, got {args.kill_every}")
    if args.repeats < 1:
        raise SystemExit(f"jaxdp.bench: goodput: --repeats must be at least 1, got {args.repeats}")
    if args.load < 0:
        raise SystemExit(f"jaxdp.bench: goodput: --load must be 0 or more busy-loop processes, got {args.load}")
    with tempfile.TemporaryDirectory(prefix="jaxdp-goodput-") as scratch, BusyLoad(args.load):
        _run(args, os.path.join(scratch, "warm"), None, steps=2)  # the compile cache: every later start finds it warm
        plain = None
        if args.elastic:
            _run(args, os.path.join(scratch, "warm-elastic"), None, steps=2, elastic=True)
            plain = _run(args, os.path.join(scratch, "plain"), None)
        rows = [_pair(args, scratch, repeat, plain) for repeat in range(args.repeats)]
    if args.repeats > 1:
        rows.append(median_row(rows))
    engine = f" --elastic --elastic-engine {args.elastic_engine}" if args.elastic else ""
    print(f"2 processes x 1 device under `python -m jaxdp.launch{engine}`, "
          f"`python -m jaxdp.train --steps {args.steps} "
          f"--save-every {args.save_every} {args.train_args}`; a random worker killed every {args.kill_every:g} s "
          f"(the compile cache warmed by a first run)" + (f"; {args.load} busy-loop processes beside it" if args.load else "")
          + (f"; {args.repeats} pairs of runs, then their medians"
                                                          if args.repeats > 1 else ""))
    print_table(rows, ([("repeat", "pair", "")] if args.repeats > 1 else [])
                + [("undisturbed_s", "undisturbed s", ".1f"), ("disturbed_s", "with kills s", ".1f"),
                   ("kills", "kills", "g"), ("goodput", "goodput", ".3f"), ("lost_per_kill_s", "lost per kill s", ".2f"),
                   ("same_final_params", "final params equal", "")]
               + ([("examples_done", "examples done", ".3f"), ("goodput_examples", "goodput x examples", ".3f")]
                  if "examples_done" in rows[0] else [])
               + ([("plain_undisturbed_s", "plain undisturbed s", ".1f"), ("goodput_vs_plain", "goodput vs plain", ".3f")]
                  if args.elastic else [])
               + ([("detect_s", "kill to left out s", ".2f"), ("restart_s", "kill to restart s", ".2f"),
                   ("back_s", "kill to healed s", ".2f"), ("left_out", "ranks left out", "g")] if args.elastic else []))
    for row in rows:
        if args.save_every == "auto" and "auto_undisturbed" in row:
            print(f"--save-every auto chose {row['auto_undisturbed']} undisturbed and {row['auto_with_kills']} with kills")
    write_json(args.json, rows)
    return rows
