"""Checkpoints written by older jaxdp commits resume with today's code and continue as they should.

tests/fixtures/checkpoints_<commit>/<mode>/ holds, per mode (see make.py there for how it was made,
by the OLD code, on an AMD EPYC): ckpt/ (the step-K checkpoint, its jaxdp_checksums.json and its
config.toml), expected.json (the flags, K, N, every logged value of the steps after K of an
uninterrupted run, the final held-out metrics) and params.npz (that run's final parameters). Each
test resumes a copy of ckpt/ with the same flags up to step N, and checks three things:

(a) The restore is exact, on any CPU: every array the checkpoint's files hold (read from them
    directly, no template) is in the restored state bit for bit, nothing else is, and the files
    still hash to the sha256 the old code recorded (`restore_problems`).
(b) Continuing from the old checkpoint is continuing from its arrays, on this machine: the
    restored state, saved again by today's Checkpointer into a new directory (with the meta this
    run's Checkpointer writes) and resumed with the config the first resume ran with (an older
    jaxdp's defaults, such as --head-bias, included), logs the same steps and held-out metrics and
    ends in the same state, bit for bit (`continuation_problems`). So nothing an old checkpoint
    records (data position, sync state, its layout) is read differently from today's.
(c) The numbers the old code computed on its machine (expected.json, params.npz) are reached within
    what floating point allows across CPUs (`mismatches`): step numbers and other integers exactly;
    float32 values to a relative REL = 1e-5 (an absolute 1e-8 near 0). XLA:CPU's reductions follow
    the CPU's vector width and its matrix kernels the CPU's caches, so another CPU gives floats
    some ulp apart, and a few steps of training (Adam's normalisation, the held-out loss after them)
    carry that to a few 1e-6: on an Intel Xeon the f0dd332 CNN's eval_loss was 7e-6 off.
    The 7a73a05 fixture resumed with XLA:CPU limited to SSE4.2 stays within it
    (test_the_comparison_holds_on_another_x86_64_instruction_set).

Tolerances of (c) that fit their arithmetic:
* bf16 compute (gpt_bf16): a rounding to 8 bits that flips on another CPU moves an update by a
  whole bf16 ulp, and Adam turns it into an lr-sized step: on the Xeon a few parameters were 7 %
  off. Its logged values and held-out metrics are compared to BF16_REL = 2**-8 (one bf16 ulp,
  relative), its parameters not elementwise but as a whole: their relative L2 distance to the
  record is at most BF16_REL too (the 4 steps after K move them by 1.5e-2 of their norm). A lost
  optimizer state moves step 8's loss by 1.4e-3 only: (a) is what finds it, exactly.
* int8 on the ring (a quantization level flipped) and PowerSGD (low-rank factors) amplify an ulp:
  `AMPLIFIED` (measured on the AMD EPYC with XLA:CPU limited to other instruction sets: int8_ring
  two grad norms 3.9e-6 and one head weight 4.7e-4 off; powersgd 48 embedding values up to 2.0e-2).
* Parameters with no gradient in exact arithmetic are rounding noise that Adam scales up to
  lr-sized steps: the attention's key bias (a constant added to every key's score, which the
  softmax ignores) and a convolution's bias before BatchNorm are checked finite, not compared.

A wrong restore fails (a) exactly and (c) too: test_a_wrong_restore_fails_the_comparison forgets one
part of the restored state (the Adam moments, the gradient in flight, BatchNorm's statistics).

The runs name their paths relative to the working directory (the checkpoints record
`--dataset corpus.txt`, and a resumed run must give the same --dataset): each test runs in a
tmp_path holding copies of ckpt/ and corpus.txt, and passes every path on the command line.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import records
from jaxdp.checkpoint import portable
from jaxdp.checkpoint.checkpointer import CHECKSUMS_FILE, Checkpointer
from jaxdp.config import parse_args
from jaxdp.train import train

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODES = {
    "checkpoints_7a73a05": ["psum", "powersgd", "local_steps", "zero1", "gpt"],
    "checkpoints_f0dd332": ["int8_ring", "overlap", "local_int4_overlap", "zero1_psum", "cnn", "gpt_bf16"],
}
MISSING = "<not logged>"
REL, FLOOR = 1e-5, 1e-8  # float32 across CPUs: relative tolerance; absolute floor for values near 0 (docstring)
BF16 = {"gpt_bf16"}  # modes whose compute is rounded to bf16
BF16_REL = 2.0 ** -8  # their logged values (relative), and their parameters' relative L2 distance: one bf16 ulp
# Modes whose arithmetic turns a last-place difference into a larger one (the docstring): an int8
# quantization level flips, PowerSGD's low-rank factors move.
AMPLIFIED = {"int8_ring": 1e-3, "powersgd": 3e-2}
EXACT = {"step", "round", "round_steps_by_process", "comm_bytes"}  # counts, also where logged as floats
TIMING = ("elapsed_s", "mfu", "step_time_by_process", "slowest_process", "round_s")  # and every "*_per_sec*"

# Seconds per resume, one process on a 2-core machine shared with other work (load average 10 to 35):
# cold compile cache, all modes: 7a73a05 psum 106, powersgd 142, local_steps 65, zero1 121, gpt 67;
# f0dd332 int8_ring 48, overlap 44, local_int4_overlap 68, zero1_psum 27, cnn 29, gpt_bf16 34 (an
# earlier cold run at lower load: 7a73a05 psum 12, powersgd 20, local_steps 7, zero1 17, gpt 8).
# Warm cache, the fast subset: local_steps 9, gpt 6, overlap 5, cnn 4. Two per fixture stay in it.
# Each test resumes twice (the old checkpoint, and its arrays saved by today's code: (b)).
FAST = {("checkpoints_7a73a05", "local_steps"), ("checkpoints_7a73a05", "gpt"),
        ("checkpoints_f0dd332", "overlap"), ("checkpoints_f0dd332", "cnn")}
CASES = [pytest.param(fixture, mode, id=f"{fixture.removeprefix('checkpoints_')}-{mode}",
                      marks=() if (fixture, mode) in FAST else pytest.mark.slow)
         for fixture, modes in MODES.items() for mode in modes]


def expected_of(fixture: str, mode: str) -> dict:
    return json.loads((FIXTURES / fixture / mode / "expected.json").read_text())


def flat(tree) -> dict[str, np.ndarray]:
    """Leaves by tree path joined with "." (the keys of params.npz)."""
    def name(path):
        return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return {name(p): np.asarray(jax.device_get(x)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def stored_params(fixture: str, mode: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / fixture / mode / "params.npz") as stored:
        return {name: stored[name] for name in stored.files}


def differs(got, want, exact: bool = False, rel: float = REL) -> bool:
    """Whether logged value `got` fails `want`: ints, strings and `exact` fields by ==, floats to `rel`
    (FLOOR near 0), lists element by element."""
    if isinstance(want, list):
        return not isinstance(got, (list, tuple)) or len(got) != len(want) or any(
            differs(g, w, exact, rel) for g, w in zip(got, want))
    if exact or not isinstance(want, float):
        return got != want
    if isinstance(got, bool) or not isinstance(got, numbers.Real):
        return True
    return not math.isclose(float(got), want, rel_tol=rel, abs_tol=FLOOR)


def mismatches(history: list[dict], summary: dict, params: dict[str, np.ndarray], expected: dict,
               stored: dict[str, np.ndarray]) -> list[str]:
    """(c): every way a resumed run's logged steps, held-out metrics and final parameters fail the
    fixture's, recorded on another CPU, beyond the tolerance of their arithmetic (empty: it
    continued as the old code did)."""
    mode = expected.get("mode")
    out, rel = [], BF16_REL if mode in BF16 else AMPLIFIED.get(mode, REL)
    got_steps, want_steps = [r.get("step") for r in history], [r["step"] for r in expected["steps"]]
    if got_steps != want_steps:
        out.append(f"logged steps {got_steps}, expected {want_steps}")
    for got, want in zip(history, expected["steps"]):
        out += [f"step {want['step']} {key}: {got.get(key, MISSING)!r}, expected {value!r}"
                for key, value in want.items() if differs(got.get(key, MISSING), value, key in EXACT, rel)]
    out += [f"{key}: {summary.get(key, MISSING)!r}, expected {value!r}"
            for key, value in expected["eval"].items() if differs(summary.get(key, MISSING), value, rel=rel)]
    if sorted(params) != sorted(stored):
        out.append(f"parameters {sorted(params)}, expected {sorted(stored)}")
    compared = []  # (got, want) of the parameters compared as a whole (bf16 modes)
    for name in sorted(set(params) & set(stored)):
        got, want = params[name], stored[name]
        if (got.dtype, got.shape) != (want.dtype, want.shape):
            out.append(f"{name}: {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}")
            continue
        if not np.isfinite(got).all():
            out.append(f"{name}: not finite")
            continue
        if re.search(r"qkv_\d+\.bias$", name) and want.shape[:1] == (3,):
            # The attention's key bias gets no gradient in exact arithmetic (it adds a constant to every
            # key's score, which the softmax ignores): its trajectory is rounding noise that Adam scales
            # up to lr-sized steps, so it differs across CPUs. Checked finite; the query and value biases
            # are compared like everything else.
            got, want = np.delete(got, 1, axis=0), np.delete(want, 1, axis=0)
        if re.fullmatch(r"Conv_\d+\.bias", name):
            # A convolution's bias before BatchNorm gets no gradient in exact arithmetic either (the
            # normalisation subtracts every constant): rounding noise, checked finite.
            continue
        if mode in BF16:
            compared.append((got, want))
            continue
        bad = ~np.isclose(got, want, rtol=rel, atol=FLOOR)
        if bad.any():
            worst = np.max(np.abs(got.astype(np.float64) - want)[bad] / np.maximum(np.abs(want[bad]), FLOOR))
            out.append(f"{name}: {np.count_nonzero(bad)} of {want.size} values differ, by up to {worst:.3g} relative")
    if compared:
        distance = relative_distance([g for g, _ in compared], [w for _, w in compared])
        if not distance <= BF16_REL:
            out.append(f"the parameters are {distance:.3g} of their norm from the record (at most {BF16_REL:.3g})")
    return out


def relative_distance(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """|got - want| / |want|, L2 over all the arrays together, in float64."""
    diff = math.sqrt(sum(float(np.sum((g.astype(np.float64) - w) ** 2)) for g, w in zip(got, want)))
    return diff / max(math.sqrt(sum(float(np.sum(w.astype(np.float64) ** 2)) for w in want)), 1e-30)


def deterministic(record: dict) -> dict:
    """A logged record without the values that measure time (they differ between runs)."""
    return {k: v for k, v in record.items() if k not in TIMING and "_per_sec" not in k}


def checkpoint_arrays(step_dir: Path) -> dict[str, np.ndarray]:
    """Every array of a checkpoint's state, read from its files without a template, by the paths
    the Checkpointer names them by (jaxdp/checkpoint/portable.py)."""
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as reader:
        metadata = reader.metadata(step_dir / "state")
        tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", None)
        tree = tree if tree is not None else getattr(metadata, "tree", metadata)
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        arrays = reader.restore(step_dir / "state", args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args))
    return {name: np.asarray(x) for name, x in portable.named_leaves(arrays).items()}


def state_arrays(state) -> dict[str, np.ndarray]:
    """Every array of a TrainState as checkpoints hold it (whole, on the host), by path."""
    return {name: np.asarray(x) for name, x in portable.named_leaves(jax.device_get(portable.to_portable(state))).items()}


def restore_problems(step_dir: Path, state: dict[str, np.ndarray]) -> list[str]:
    """(a): how a restored state (`state_arrays`) differs from the checkpoint's files (empty: bit
    for bit), and which of those files no longer hash to what the old code recorded."""
    files = checkpoint_arrays(step_dir)
    recorded = json.loads((step_dir / CHECKSUMS_FILE).read_text())
    out = [f"{name}: the file's bytes do not hash to the recorded sha256"
           for name, digest in portable.checksums(files).items() if recorded.get(name) != digest]
    out += [f"{name}: recorded but not in the files" for name in sorted(set(recorded) - set(files))]
    out += [f"{name}: in the checkpoint, not in the restored state" for name in sorted(set(files) - set(state))]
    out += [f"{name}: in the restored state, not in the checkpoint" for name in sorted(set(state) - set(files))]
    for name in sorted(set(files) & set(state)):
        got, want = state[name], files[name]
        if (got.dtype, got.shape) != (want.dtype, want.shape) or got.tobytes() != want.tobytes():
            out.append(f"{name}: restored {got.dtype}{list(got.shape)} is not the stored {want.dtype}{list(want.shape)} "
                       f"bit for bit")
    return out


def continuation_problems(old, today) -> list[str]:
    """(b): how two resumed runs' logged steps, held-out metrics and final states differ (empty:
    bit for bit)."""
    out = []
    if [deterministic(r) for r in old.history] != [deterministic(r) for r in today.history]:
        out.append(f"logged steps {[deterministic(r) for r in old.history]} != {[deterministic(r) for r in today.history]}")
    evals = {k: v for k, v in old.summary.items() if k.startswith("eval_")}
    if not evals or evals != {k: v for k, v in today.summary.items() if k.startswith("eval_")}:
        out.append(f"held-out metrics {evals} != {today.summary}")
    a, b = state_arrays(old.state), state_arrays(today.state)
    if sorted(a) != sorted(b):
        out.append(f"final states hold {sorted(a)} != {sorted(b)}")
    out += [f"final {name} differs" for name in sorted(set(a) & set(b))
            if (a[name].dtype, a[name].shape, a[name].tobytes()) != (b[name].dtype, b[name].shape, b[name].tobytes())]
    return out


class Resumed:
    """What `resume` saw: the run's result, its "start" records, and the state its Checkpointer
    restored (`restored`: its `state_arrays`, None if it restored nothing)."""

    def __init__(self, result, start, restored, config):
        self.result, self.start, self.restored, self.config = result, start, restored, config


def resume(fixture: str, mode: str, where: Path, checkpoint: str = "ckpt", resave: str | None = None,
           config=None) -> Resumed:
    """Resume the fixture's step-K checkpoint (a copy, in `where`) up to step N with the flags it
    was made with. `checkpoint`, `config`: resume that directory of `where` instead, with that
    config (a Config: what an earlier `resume` ran with, its `config`). `resave`: a directory (in
    `where`) that today's Checkpointer writes the restored state to, with what this run's
    Checkpointer would record (its config, the rest of its meta)."""
    expected = expected_of(fixture, mode)
    k, n = expected["K"], expected["N"]
    if not (where / "ckpt").exists():
        shutil.copytree(FIXTURES / fixture / mode / "ckpt", where / "ckpt")
    shutil.copy(FIXTURES / fixture / "corpus.txt", where / "corpus.txt")
    seen, configs = [], []
    real = Checkpointer.restore

    def restore(self, state):
        restored = real(self, state)
        configs.append(self.config)  # with the defaults of the jaxdp that made the checkpoint (--head-bias ...)
        seen.append(state_arrays(restored) if restored is not state else None)  # (the steps donate it)
        if resave is not None and restored is not state:
            today = Checkpointer(os.path.join(where, resave), config=self.config)
            today.extra_meta, today.data_state = dict(self.extra_meta), self.data_state
            with today:
                today.save(restored)
        return restored
    metrics = f"{checkpoint}.jsonl"
    with contextlib.chdir(where), pytest.MonkeyPatch.context() as patch:
        patch.setattr(Checkpointer, "restore", restore)
        if config is None:
            config = parse_args([*expected["flags"], "--steps", str(n), "--checkpoint-dir", checkpoint, "--save-every",
                                 str(k), "--keep", "1", "--log-every", "1", "--no-progress", "--metrics-file", metrics])
        result = train(config.replace(checkpoint_dir=checkpoint, metrics_file=metrics))
    return Resumed(result, [r for r in records(where / metrics) if r.get("event") == "start"], seen[0] if seen else None,
                   configs[0] if configs else None)


@pytest.mark.parametrize("fixture, mode", CASES)
def test_an_old_checkpoint_resumes_and_continues_to_the_same_numbers(tmp_path, fixture, mode):
    expected = expected_of(fixture, mode)
    old = resume(fixture, mode, tmp_path, resave="today")
    # Resumed from the fixture's step K, not a fresh run.
    assert len(old.start) == 1 and old.start[0]["resumed_from"] == expected["K"], old.start
    assert int(old.result.state.step) == expected["N"]
    # (a) the restore is exact: the checkpoint's files, bit for bit, and they hash as recorded
    problems = restore_problems(FIXTURES / fixture / mode / "ckpt" / str(expected["K"]), old.restored)
    assert not problems, "\n".join(problems)
    # (b) today's checkpoint of the same arrays continues the same way, bit for bit (this machine)
    today = resume(fixture, mode, tmp_path, checkpoint="today", config=old.config)
    assert len(today.start) == 1 and today.start[0]["resumed_from"] == expected["K"], today.start
    problems = continuation_problems(old.result, today.result)
    assert not problems, "\n".join(problems)
    # (c) the old code's numbers, recorded on another CPU, within the tolerance of their arithmetic
    problems = mismatches(old.result.history, old.result.summary, flat(old.result.state.params), expected,
                          stored_params(fixture, mode))
    assert not problems, "\n".join(problems)


def forget(part: str):
    """A wrong restore: the checkpoint read for real, then `part` of the state (a TrainState field)
    taken from the fresh state the run started with instead of from the checkpoint."""
    real = Checkpointer.restore

    def restore(self, state):
        return real(self, state).replace(**{part: getattr(state, part)})
    return restore


@pytest.mark.parametrize("fixture, mode, part", [
    pytest.param("checkpoints_7a73a05", "gpt", "opt_state", id="adam-moments-lost"),
    pytest.param("checkpoints_f0dd332", "overlap", "sync", id="gradient-in-flight-lost", marks=pytest.mark.slow),
    pytest.param("checkpoints_f0dd332", "cnn", "model_state", id="batchnorm-statistics-lost", marks=pytest.mark.slow),
])
def test_a_wrong_restore_fails_the_comparison(tmp_path, monkeypatch, fixture, mode, part):
    monkeypatch.setattr(Checkpointer, "restore", forget(part))
    expected = expected_of(fixture, mode)
    old = resume(fixture, mode, tmp_path)
    assert old.start[0]["resumed_from"] == expected["K"]  # the step count was restored: only `part` is wrong
    # (a) names exactly the arrays that were lost
    problems = restore_problems(FIXTURES / fixture / mode / "ckpt" / str(expected["K"]), old.restored)
    assert problems and all(p.startswith(f"{part}/") for p in problems), problems
    # (c) finds it too, across CPUs' tolerances
    problems = mismatches(old.result.history, old.result.summary, flat(old.result.state.params), expected,
                          stored_params(fixture, mode))
    assert problems
    if part == "model_state":  # BatchNorm's running statistics are read by the evaluation only
        assert all(p.startswith("eval_") for p in problems), problems


def test_the_comparison_takes_another_cpu_s_rounding_and_refuses_more_than_its_tolerance():
    """`mismatches` on the fixtures' own numbers (no training): an ulp or a few 1e-6 off passes (the
    Intel Xeon's CNN eval_loss, bf16 parameters with a few values 7 % off), what a wrong restore does
    (a relative 3e-5, a step, a round, a byte count; bf16 parameters 4 steps old) fails."""
    expected, stored = expected_of("checkpoints_f0dd332", "local_int4_overlap"), stored_params("checkpoints_f0dd332",
                                                                                               "local_int4_overlap")
    eval_ = expected["eval"]
    assert mismatches(expected["steps"], eval_, stored, expected, stored) == []

    def ulp(x: float) -> float:
        return float(np.nextafter(np.float32(x), np.float32(np.inf)))
    steps = [{k: ulp(v) if isinstance(v, float) and k not in EXACT else v for k, v in r.items()} for r in expected["steps"]]
    params = {name: np.nextafter(a, np.float32(np.inf)) for name, a in stored.items()}
    near_zero = {name: np.where(np.abs(a) < 1e-6, a + np.float32(5e-9), a) for name, a in params.items()}
    assert any(not np.array_equal(a, b) for a, b in zip(params.values(), stored.values()))
    assert mismatches(steps, {k: ulp(v) for k, v in eval_.items()}, near_zero, expected, stored) == []
    few = {name: a * np.float32(1 + 8e-6) for name, a in stored.items()}  # some ulp: a few steps on another CPU
    assert mismatches(expected["steps"], eval_, few, expected, stored) == []

    first = expected["steps"][0]
    for key, wrong in [("loss", first["loss"] * (1 + 3e-5)), ("step", first["step"] + 1), ("round", first["round"] + 1),
                       ("comm_bytes", first["comm_bytes"] + 1.0), ("round_steps_by_process", [3])]:
        bad = [{**first, key: wrong}, *expected["steps"][1:]]
        assert mismatches(bad, eval_, stored, expected, stored), key
    assert mismatches(expected["steps"], {**eval_, "eval_loss": eval_["eval_loss"] * (1 - 3e-5)}, stored, expected, stored)
    assert mismatches(expected["steps"], {}, stored, expected, stored)  # a held-out metric not logged
    name = sorted(stored)[0]
    for wrong in (stored[name] * np.float32(1 + 3e-5), stored[name].astype(np.float64), stored[name][:-1],
                  np.full_like(stored[name], np.nan)):
        assert mismatches(expected["steps"], eval_, {**stored, name: wrong}, expected, stored), wrong.dtype

    # The f0dd332 CNN resumed on an Intel Xeon: its eval_loss 2.25299238 against the recorded 2.25297640.
    cnn, cnn_params = expected_of("checkpoints_f0dd332", "cnn"), stored_params("checkpoints_f0dd332", "cnn")
    assert cnn["eval"]["eval_loss"] == pytest.approx(2.25297640, abs=1e-8)
    assert mismatches(cnn["steps"], {**cnn["eval"], "eval_loss": 2.25299238}, cnn_params, cnn, cnn_params) == []

    # bf16: a few parameters 7 % off pass, the parameters of 4 steps before (the checkpoint's) do not.
    bf16, bf16_params = expected_of("checkpoints_f0dd332", "gpt_bf16"), stored_params("checkpoints_f0dd332", "gpt_bf16")
    flipped = dict(bf16_params)
    for name in ("fc_0.bias", "head.bias", "qkv_0.kernel"):
        flipped[name] = flipped[name].copy()
        flipped[name].reshape(-1)[:3] *= np.float32(1.07)
    assert any(not np.array_equal(flipped[n], bf16_params[n]) for n in flipped)
    assert mismatches(bf16["steps"], bf16["eval"], flipped, bf16, bf16_params) == []
    at_k = {name.removeprefix("params/").replace("/", "."): a for name, a in
            checkpoint_arrays(FIXTURES / "checkpoints_f0dd332" / "gpt_bf16" / "ckpt" / str(bf16["K"])).items()
            if name.startswith("params/")}
    assert sorted(at_k) == sorted(bf16_params)
    assert mismatches(bf16["steps"], bf16["eval"], at_k, bf16, bf16_params)
    loss = bf16["steps"][-1]["loss"]
    assert mismatches([*bf16["steps"][:-1], {**bf16["steps"][-1], "loss": loss * (1 + 2e-3)}], bf16["eval"],
                      bf16_params, bf16, bf16_params) == []
    assert mismatches([*bf16["steps"][:-1], {**bf16["steps"][-1], "loss": loss * (1 + 1e-2)}], bf16["eval"],
                      bf16_params, bf16, bf16_params)


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86-64 instruction set")
def test_the_comparison_holds_on_another_x86_64_instruction_set(tmp_path):
    """The 7a73a05 psum fixture resumed in a process whose XLA:CPU may use SSE4.2 only (no AVX, no
    FMA), as on an older x86-64 CPU: (a) and (b) hold bit for bit there too, and its numbers, not
    the fixture's bit for bit, pass (c)."""
    fixture, mode = "checkpoints_7a73a05", "psum"
    script = ("import json, sys, numpy as np; import test_checkpoint_compat as t; from pathlib import Path; "
              "where, fixture, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]; "
              "old = t.resume(fixture, mode, where, resave='today'); "
              "today = t.resume(fixture, mode, where, checkpoint='today', config=old.config); "
              "k = t.expected_of(fixture, mode)['K']; "
              "problems = t.restore_problems(t.FIXTURES / fixture / mode / 'ckpt' / str(k), old.restored) "
              "+ t.continuation_problems(old.result, today.result); "
              "(where / 'got.json').write_text(json.dumps({'history': old.result.history, 'summary': old.result.summary, "
              "'problems': problems}, default=float)); np.savez(where / 'got.npz', **t.flat(old.result.state.params))")
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_cpu_max_isa"))
    env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_cpu_max_isa=SSE4_2".strip(),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path), fixture, mode], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads((tmp_path / "got.json").read_text())
    assert got["problems"] == []  # (a) and (b)
    with np.load(tmp_path / "got.npz") as npz:
        params = {name: npz[name] for name in npz.files}
    expected, stored = expected_of(fixture, mode), stored_params(fixture, mode)
    identical = all(params[name].tobytes() == stored[name].tobytes() for name in stored) and all(
        {k: g.get(k) for k in w} == w for g, w in zip(got["history"], expected["steps"]))
    if identical:
        pytest.skip("XLA:CPU limited to SSE4.2 gave the fixture's numbers bit for bit: nothing to tolerate here")
    problems = mismatches(got["history"], got["summary"], params, expected, stored)
    assert not problems, "\n".join(problems)


def test_the_fixtures_hold_what_their_make_py_says():
    """The checkpoints are the ones the modes need (no JAX: the fixtures' own files)."""
    for fixture, modes in MODES.items():
        assert (FIXTURES / fixture / "corpus.txt").read_bytes() == (FIXTURES / "checkpoints_7a73a05" / "corpus.txt").read_bytes()
        for mode in modes:
            expected = expected_of(fixture, mode)
            k, n = expected["K"], expected["N"]
            assert expected["mode"] == mode and fixture.removeprefix("checkpoints_") in expected["made_by"]
            ckpt = FIXTURES / fixture / mode / "ckpt"
            assert sorted(p.name for p in ckpt.iterdir()) == [str(k), "config.toml"], mode
            logged = [r["step"] for r in expected["steps"]]
            assert 0 < k < logged[0] and logged == sorted(set(logged)) and logged[-1] == n, mode
            assert all(np.isfinite(r["loss"]) for r in expected["steps"]) and expected["eval"]
            meta = json.loads((ckpt / str(k) / "meta" / "metadata").read_text())
            assert meta["step"] == k and meta["devices"] == 8, mode
            assert not os.path.isabs(meta.get("dataset_path", "")), mode  # nothing names the maker's directories
            described = (ckpt / str(k) / "state" / "_METADATA").read_text()
            if mode in ("powersgd", "int8_ring", "local_int4_overlap"):  # error feedback was saved
                assert "compression" in described
                assert all(r["compressed"] == 1.0 if mode == "powersgd" else r["compression_ratio"] > 3
                           for r in expected["steps"])
            if mode == "local_steps":  # the replicas, two steps into a period of 4; steps 7..10 cross a sync
                assert "local_sgd" in described and k % 4 != 0
                assert [r["synced"] for r in expected["steps"]] == [float(s % 4 == 0) for s in range(k + 1, n + 1)]
            if mode == "overlap":  # every-step overlap: the gradient in flight
                assert "delayed" in described and "--overlap" in expected["flags"]
            if mode == "local_int4_overlap":  # rounds of 4, saved between rounds with round 2's delta in flight
                assert "local_sgd" in described and "overlap" in described and k % 4 == 0
                assert [r["round"] for r in expected["steps"]] == [3, 4] and logged == [12, 16]
            if mode == "cnn":  # BatchNorm's statistics
                assert "batch_stats" in described and "eval_accuracy" in expected["eval"]
