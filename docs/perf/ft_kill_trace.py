"""One kill in an elastic run on torchft, line by line: what the launcher and the workers print, each
line with its time since the kill (seconds). Run from the repository root, torchft installed:

    python docs/perf/ft_kill_trace.py [STEPS]                 # KILL_AT=20 (s after the start), HB=0.5 (heartbeat)
                                                              # RANK=0: kill the lead instead of worker 1
                                                              # SAVE_EVERY=100: save as the goodput bench does
                                                              # TRAIN_ARGS="--strategy ring --compression int8": the mode

It starts `python -m jaxdp.launch --elastic --elastic-engine torchft --nproc-per-node 2 --max-restarts 10
[--heartbeat-timeout HB] -- python -m jaxdp.train --strategy psum --devices 1 --steps STEPS`, kills worker
RANK (default 1) with SIGKILL KILL_AT seconds in, and prints the lines after the kill: when the survivor left it out
("live ranks [0]"), when the restarted worker joined with a live worker's state, when both train again.
TREE: the checkout to run (default: the current directory).
"""
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

from jaxdp.bench.goodput import training_processes

steps = sys.argv[1] if len(sys.argv) > 1 else "4000"
tree = os.environ.get("TREE", os.getcwd())
heartbeat = ["--heartbeat-timeout", os.environ["HB"]] if os.environ.get("HB") else []
cmd = [sys.executable, "-m", "jaxdp.launch", "--elastic", "--elastic-engine", "torchft", "--nproc-per-node", "2",
       "--max-restarts", "10", *heartbeat, "--", sys.executable, "-m", "jaxdp.train",
       *os.environ.get("TRAIN_ARGS", "--strategy psum").split(), "--devices", "1", "--steps", steps, "--no-progress", "--log-every", "100",
       *(["--checkpoint-dir", tempfile.mkdtemp(), "--save-every", os.environ["SAVE_EVERY"]]
         if os.environ.get("SAVE_EVERY") else [])]
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tree,
                        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
killed: list[float] = []


def echo() -> None:
    for line in proc.stdout:
        if killed:
            print(f"{time.monotonic() - killed[0]:+7.2f} {line.rstrip()[:200]}", flush=True)


threading.Thread(target=echo, daemon=True).start()
time.sleep(float(os.environ.get("KILL_AT", "20")))
rank = os.environ.get("RANK", "1")
victim = None
for pid in training_processes(proc.pid):  # this launcher's workers (the zygote's children included)
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"JAXDP_ELASTIC_RANK={rank}".encode() in f.read().split(b"\0"):
                victim = pid
    except OSError:
        continue
if victim is None:
    proc.kill()
    sys.exit(f"worker {rank} was not found (did the run start?)")
killed.append(time.monotonic())
print(f"  +0.00 SIGKILL to worker {rank} (pid {victim})", flush=True)
os.kill(victim, signal.SIGKILL)
sys.exit(proc.wait())
