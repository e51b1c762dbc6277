"""Where metrics go: a JSON Lines file, TensorBoard, Weights & Biases, and a progress bar. Process 0 only.

Every method is a no-op on other processes, so the trainer calls them unconditionally and the
process-0 role is decided once, here. A custom loop in a notebook uses the same pieces:

    writer = jaxdp.MetricsWriter(is_main=jax.process_index() == 0, total_steps=1000, metrics_file="m.jsonl")
    for step in range(1000):
        state, metrics = train_step(state, batch)
        if step == 0:
            writer.first_step_done(1)        # compilation: timed apart; rates start here
        writer.step()
        if (step + 1) % 10 == 0:
            host = jax.device_get(metrics)   # a host sync point
            jaxdp.check_finite(step + 1, host)  # raises jaxdp.Diverged naming the step
            writer.log(step + 1, host)

The file: one JSON object per line, always valid JSON. A run's first record is
`{"event": "start", "config": {...}, ...}` (a resumed run appends another, with "resumed_from"),
then one record per logged step (`step`, `loss`, the model's metrics, `lr`, `steps_per_sec`, ...),
`{"event": "eval", ...}` records from periodic evaluation, and a last `{"event": "done", ...}` with
the held-out metrics. A value that is not a finite number is written as the string "NaN",
"Infinity" or "-Infinity" (bare NaN is not JSON).

Weights & Biases (`wandb_project=`, `pip install 'jaxdp-trainer[wandb]'`) gets the same records: the run
starts at the "start" record, with its config; each logged step's numbers as `train/<name>`, eval
records and the "done" record's as `eval/<name>` (the "done" record also as the run's summary),
other events' numbers as `<event>/<name>`, all against the x-axis `step`. With `wandb_id_dir` (the
command line passes --checkpoint-dir) the W&B run id is kept there in `wandb-run-id`, so a resumed
run (`start_step` > 0) continues the same W&B run; a fresh run starts a new one. A resumed run may
log again steps the W&B run already has (a crash after the last checkpoint): they are plotted
against `step` as they come, not refused, which W&B's own step counter would do. W&B reads its own
settings from the environment (WANDB_ENTITY, WANDB_NAME, WANDB_MODE=offline, WANDB_DIR, ...); its
console capture is off, so it leaves the progress bar and the terminal alone.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Callable, Iterator, Mapping

from tqdm import tqdm

WANDB_ID_FILE = "wandb-run-id"  # in `wandb_id_dir`: the W&B run a resumed run continues
BAR_MININTERVAL = 0.5  # seconds between progress bar refreshes


class Diverged(ArithmeticError):
    """A training metric became NaN or infinite: `step` is the first step where it was seen."""

    def __init__(self, step: int, name: str, value: float):
        super().__init__(f"{name} became {value} at step {step}")
        self.step, self.name, self.value = step, name, value


def check_finite(step: int, metrics: Mapping[str, Any], names: tuple[str, ...] = ("loss", "grad_norm")) -> None:
    """Raise `Diverged` if any of `names` in `metrics` (host values) is NaN or infinite."""
    for name in names:
        if name in metrics and not math.isfinite(float(metrics[name])):
            raise Diverged(step, name, float(metrics[name]))


class Periodic:
    """`action(step, ...)` every `every` steps (never when `every` is 0), like clu's periodic actions.

        evaluate = jaxdp.Periodic(100, lambda step, state: run_eval(state))
        evaluate(step, state)   # runs on steps 100, 200, ...
    """

    def __init__(self, every: int, action: Callable[..., Any]):
        self.every, self.action = every, action

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def __call__(self, step: int, *args: Any, **kwargs: Any) -> Any:
        return self.action(step, *args, **kwargs) if self.due(step) else None


# Dense peak of one device, TFLOP/s, by a substring of JAX's `device_kind` (vendor data sheets, SXM
# parts, without sparsity), for MFU. Other devices report no MFU.
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def peak_tflops(device_kind: str, dtype: str) -> float | None:
    """A known device's dense peak for `dtype` ("bfloat16"/"bf16"), else None."""
    if dtype not in ("bfloat16", "bf16"):
        return None
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_kind), None)


def json_safe(value: Any) -> Any:
    """Floats that JSON cannot hold as numbers become "NaN", "Infinity" or "-Infinity"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class MetricsWriter:
    """JSON Lines, TensorBoard and a progress bar for one run, written by process 0.

    `examples_per_step`, `tokens_per_step` and `flops_per_step` turn the measured step rate into
    examples/s, tokens/s and, with `peak_flops` (of all devices together), MFU.
    """

    def __init__(self, *, is_main: bool, total_steps: int, start_step: int = 0,
                 metrics_file: str | None = None, log_dir: str | None = None, progress: bool = True,
                 examples_per_step: int | None = None, tokens_per_step: int | None = None,
                 flops_per_step: float | None = None, peak_flops: float | None = None,
                 wandb_project: str | None = None, wandb_id_dir: str | None = None):
        self.is_main = is_main
        self._jsonl = self._tensorboard = self._bar = self._wandb = None
        self._t0 = time.perf_counter()
        self._last = (start_step, self._t0)
        self._total, self._progress = total_steps, progress
        self._per_step = {"examples_per_sec": examples_per_step, "tokens_per_sec": tokens_per_step}
        self._flops_per_step, self._peak_flops = flops_per_step, peak_flops
        self.compile_s: float | None = None
        self._sinks = (metrics_file, log_dir, wandb_project, wandb_id_dir)
        if is_main:
            self._open(start_step, resumed=bool(start_step))

    def _open(self, step: int, resumed: bool) -> tuple[int, int]:
        """Open the sinks; returns the metrics file's last (step, round) (`_order`; `step` where there is
        none to keep)."""
        metrics_file, log_dir, wandb_project, wandb_id_dir = self._sinks
        last = (step, 0)
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            # A resumed run continues the file of the run it resumes, from the checkpoint's step.
            if resumed:
                last = _keep_records_up_to(metrics_file, step)
            self._jsonl = open(metrics_file, "a" if resumed else "w", buffering=1)
        if log_dir:
            from tensorboardX import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir)
        if wandb_project:
            self._wandb = WandbSink(wandb_project, wandb_id_dir, resumed=resumed)
        return last

    def take_over(self, step: int, logged: list[dict[str, Any]] = ()) -> None:
        """This process writes from `step` on (an elastic run's lead moved here: jaxdp/loop/lead.py): the
        file continues from `step` (records past it, and a torn last line, dropped), TensorBoard gets a
        new event file in its directory, a W&B run goes on by its id, and the progress bar starts at
        `step`. `logged`: this process's own records of the steps so far (what `log` returned), written
        where the file's last (step, round) is older (the steps or rounds the former lead took but did
        not write; a round without steps has its round's step)."""
        if self.is_main:
            return
        self.is_main = True
        last = self._open(step, resumed=True)
        for record in logged:
            if last < _order(record) and record["step"] <= step:
                self._write(record)
                self._scalars("train", record, record["step"])
        if self._progress and self.compile_s is not None and step < self._total:
            self._bar = tqdm(total=self._total, initial=step, unit="step", dynamic_ncols=True,
                             file=sys.stderr, mininterval=BAR_MININTERVAL)

    def last_step(self) -> int:
        """The highest step of the metrics file's records (0: no file, or none)."""
        path = self._sinks[0]
        if not path or not os.path.exists(path):
            return 0
        return max((_order(record)[0] for _, record in _records(path)), default=0)

    def hand_over(self) -> None:
        """This process writes no more (an elastic run's lead moved elsewhere); `take_over` undoes it."""
        self.close()
        self.is_main = False

    def _write(self, record: dict[str, Any]) -> None:
        if self._jsonl:
            self._jsonl.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        if self._wandb:
            self._wandb.write(record)

    def event(self, name: str, step: int, **fields: Any) -> dict[str, Any]:
        """A record that is not a logged step: `{"event": name, "step": step, **fields}`. The run's
        first is "start", with its configuration (a resumed run appends another)."""
        record = {"event": name, "step": step, **fields}
        if self.is_main:
            self._write(record)
        return record

    def decision(self, name: str, step: int, line: str, **fields: Any) -> dict[str, Any]:
        """A decision the program took for the user: the event `name` with `fields`, and `line` once
        on the console ("jaxdp: " + line, process 0). The time it took to decide is left out of the
        rates (`restart_clock`)."""
        record = self.event(name, step, **fields)
        self.restart_clock()
        if self.is_main:
            print(f"jaxdp: {line}", file=sys.stderr)
        return record

    def first_step_done(self, step: int) -> float:
        """Call once the first step's result is ready: its time is compilation plus one step, and
        is reported apart (`compile_s`); rates and the progress bar's ETA start from here."""
        now = time.perf_counter()
        self.compile_s = now - self._last[1]
        self._last = (step, now)
        if self.is_main and self._progress and step < self._total:  # (a bar born full would print twice)
            self._bar = tqdm(total=self._total, initial=step, unit="step", dynamic_ncols=True,
                             file=sys.stderr, mininterval=BAR_MININTERVAL)
        return self.compile_s

    def restart_clock(self) -> None:
        """Leave the time since the last mark out of the next rate and of `compile_s` (work that is
        neither training nor compilation, e.g. the compression controller's measurements)."""
        self._last = (self._last[0], time.perf_counter())

    def step(self, n: int = 1) -> None:
        if self._bar is None:
            return
        if self._bar.n + n >= self._bar.total:
            # The last step: count it without drawing. `done` or `close` draws the final line once,
            # with the last loss (drawn here too, it came out twice: 100% with the loss before it,
            # then 100% again from close).
            self._bar.n += n
        else:
            self._bar.update(n)

    def log(self, step: int, metrics: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Write one logged step; `metrics` are host values. Returns the record written."""
        now = time.perf_counter()
        last_step, last_time = self._last
        self._last = (step, now)
        # No rate for a log point right after the first (compiling) step: null, not a made-up number.
        rate = (step - last_step) / (now - last_time) if now > last_time and step > last_step else None
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}, **(extra or {}), "steps_per_sec": rate}
        for name, per_step in self._per_step.items():
            if per_step:
                record[name] = None if rate is None else rate * per_step
        if self._flops_per_step and self._peak_flops:
            record["mfu"] = None if rate is None else rate * self._flops_per_step / self._peak_flops
        record["elapsed_s"] = now - self._t0
        if not self.is_main:
            return record
        self._write(record)
        self._scalars("train", record, step)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        return record

    def eval(self, step: int, results: Mapping[str, Any]) -> dict[str, Any]:
        """A periodic held-out evaluation: `{"event": "eval", "step": ..., **results}`."""
        record = {"event": "eval", "step": step, **results, "elapsed_s": time.perf_counter() - self._t0}
        if self.is_main:
            self._write(record)
            self._scalars("eval", results, step)
        return record

    def done(self, step: int, summary: dict[str, Any]) -> dict[str, Any]:
        record = {"event": "done", "step": step, **summary, "elapsed_s": time.perf_counter() - self._t0}
        if not self.is_main:
            return record
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._write(record)
        self._scalars("eval", summary, step)
        return record

    def _scalars(self, prefix: str, values: Mapping[str, Any], step: int) -> None:
        if self._tensorboard:
            for name, value in values.items():
                if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(f"{prefix}/{name}", value, step)

    def close(self) -> None:
        for handle in (self._bar, self._jsonl, self._tensorboard, self._wandb):
            if handle is not None:
                handle.close()
        self._bar = self._jsonl = self._tensorboard = self._wandb = None


class WandbSink:
    """The records of a MetricsWriter, sent to Weights & Biases (see the module docstring). The
    run starts at the first record (the "start" record, whose config becomes the run's config)."""

    def __init__(self, project: str, id_dir: str | None = None, resumed: bool = False):
        try:
            import wandb
        except ImportError:
            from jaxdp.errors import InputError

            raise InputError("logging to Weights & Biases (wandb_project) needs the wandb package: "
                             "pip install 'jaxdp-trainer[wandb]'", setting="wandb_project") from None
        self._wandb, self._project, self._run = wandb, project, None
        self._id_file = os.path.join(id_dir, WANDB_ID_FILE) if id_dir else None
        self._run_id = None
        if resumed and self._id_file and os.path.exists(self._id_file):
            with open(self._id_file) as f:
                self._run_id = f.read().strip() or None
        self.resumed = self._run_id is not None

    def _start(self, config: dict[str, Any]) -> None:
        wandb = self._wandb
        self._run = wandb.init(project=self._project, id=self._run_id, resume="allow" if self._run_id else None,
                               config=config, settings=wandb.Settings(console="off"))
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        if self._id_file and not self.resumed:
            os.makedirs(os.path.dirname(self._id_file), exist_ok=True)
            write_text_atomically(self._id_file, self._run.id + "\n")

    def write(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if self._run is None:
            start = event == "start"
            config = dict(record.get("config") or {}) if start else {}
            if start:  # the rest of the start record: processes, devices, jax, ...
                config["run"] = {k: v for k, v in record.items() if k not in ("event", "step", "config")}
            self._start(config)
            if start:
                return
        elif event == "start":  # another start record (a notebook's second run in one writer)
            self._run.config.update({"run": {k: v for k, v in record.items() if k not in ("event", "step", "config")}},
                                    allow_val_change=True)
            return
        prefix = {None: "train", "eval": "eval", "done": "eval"}.get(event, event)
        numbers = {f"{prefix}/{k}": v for k, v in record.items()
                   if k not in ("event", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers:
            self._run.log({"step": record.get("step"), **numbers})
        if event == "done":
            self._run.summary.update({k: v for k, v in record.items() if k != "event" and _plain(v)})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _records(path: str) -> Iterator[tuple[str, dict]]:
    """(line, record) of each record of a metrics file; a torn line, or one not an object, is skipped."""
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield line, record


def _order(record: dict) -> tuple[int, int]:
    """Where a record stands in the file: (step, round); records of rounds without steps share a step."""
    return record.get("step") or 0, record.get("round") or 0


def _keep_records_up_to(path: str, step: int) -> tuple[int, int]:
    """Drop what a resumed run will write again: records after `step` (a crashed run got past its
    last checkpoint) and a torn last line. A finished run's "done" record at or before `step` (the
    run is being extended) keeps its held-out metrics as an "eval" record marked `"finished": true`,
    so the file still ends with one "done" record. Replaces the file atomically, so a crash here
    leaves the old file. Returns the last (step, round) kept (`_order`; (0, 0): none, or no file)."""
    if not os.path.exists(path):
        return 0, 0
    kept, last = [], (0, 0)
    for line, record in _records(path):
        if (record.get("step") or 0) > step:
            continue
        if record.get("event") == "done":
            line = json.dumps({**record, "event": "eval", "finished": True}) + "\n"
        kept.append(line if line.endswith("\n") else line + "\n")
        last = max(last, _order(record))
    write_text_atomically(path, "".join(kept))
    return last


def write_text_atomically(path: str, text: str) -> None:
    """Write `path` through a temporary file and a rename, so a crash never leaves half a file, and an
    interrupt (Ctrl-C) or an error on the way leaves no temporary file behind."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)
