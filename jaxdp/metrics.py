"""Where metrics go: a JSON Lines file, TensorBoard, and a progress bar. Process 0 only.

Every method is a no-op on other processes, so the trainer calls them unconditionally and the
process-0 role is decided once, here.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from tqdm import tqdm


class MetricsWriter:
    def __init__(self, *, is_main: bool, total_steps: int, start_step: int = 0,
                 metrics_file: str | None = None, log_dir: str | None = None, progress: bool = True):
        self.is_main = is_main
        self._jsonl = self._tensorboard = self._bar = None
        self._t0 = time.perf_counter()
        self._last = (start_step, self._t0)
        if not is_main:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            # A resumed run continues the file of the run it resumes, from the checkpoint's step.
            if start_step:
                _keep_records_up_to(metrics_file, start_step)
            self._jsonl = open(metrics_file, "a" if start_step else "w", buffering=1)
        if log_dir:
            from tensorboardX import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir)
        if progress:
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             file=sys.stderr, mininterval=0.5)

    def step(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def log(self, step: int, metrics: dict[str, Any], examples_per_step: int,
            extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write one logged step; `metrics` are host values; `extra` keys are added as they are
        (e.g. the straggler report of jaxdp/heartbeat.py). Returns the record written."""
        now = time.perf_counter()
        last_step, last_time = self._last
        self._last = (step, now)
        rate = (step - last_step) / (now - last_time) if now > last_time else math.nan
        record = {"step": step, **{k: float(v) for k, v in metrics.items()},
                  "steps_per_sec": rate, "examples_per_sec": rate * examples_per_step,
                  "elapsed_s": now - self._t0, **(extra or {})}
        if not self.is_main:
            return record
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tensorboard:
            for name, value in record.items():
                if name != "step" and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(f"train/{name}", value, step)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        return record

    def done(self, step: int, summary: dict[str, Any]) -> dict[str, Any]:
        record = {"event": "done", "step": step, **summary, "elapsed_s": time.perf_counter() - self._t0}
        if not self.is_main:
            return record
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tensorboard:
            for name, value in summary.items():
                if isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(f"eval/{name}", value, step)
        return record

    def close(self) -> None:
        for handle in (self._bar, self._jsonl, self._tensorboard):
            if handle is not None:
                handle.close()
        self._bar = self._jsonl = self._tensorboard = None


def _keep_records_up_to(path: str, step: int) -> None:
    """Drop what a resumed run will write again: records after `step` (a crashed run got past its
    last checkpoint), "done" records (the run goes on) and a torn last line. Replaces the file
    atomically, so a crash here leaves the old file."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and record.get("event") != "done" and record.get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
