"""Checkpoints written by older jaxdp commits resume with today's code and continue to the same numbers.

tests/fixtures/checkpoints_<commit>/<mode>/ holds, per mode (see make.py there for how it was made,
by the OLD code): ckpt/ (the step-K checkpoint and its config.toml), expected.json (the flags, K, N,
every logged value of the steps after K of an uninterrupted run, the final held-out metrics) and
params.npz (that run's final parameters). Each test resumes a copy of ckpt/ with the same flags up
to step N and requires the same numbers (`mismatches`): step numbers and other integers (rounds,
byte counts) exactly, every logged float and every parameter to a relative 1e-6 (about 8 ulp of
float32), or an absolute 1e-8 for values near 0.

Why not bit for bit: XLA:CPU compiles for the vector instructions of the CPU it runs on (SSE, AVX2,
AVX-512), and a reduction adds in an order that follows the vector width, so the same program gives
floats 1 ulp apart on another x86-64 CPU: the 7a73a05 fixture (made on an AVX2 machine) resumed
with XLA:CPU limited to SSE4.2 logs 1.8163446187973022 for step 8's loss where the fixture says
1.8163444995880127 (test_the_comparison_holds_on_another_x86_64_instruction_set). Large parameters
differ by an ulp or two; small ones (an initial value near 0 plus a few updates) by up to 1.5e-9
absolute, the rounding of the updates (lr 1e-3 times float32's 1.2e-7, a few steps), which is
what the absolute floor covers: 1e-8 is still five orders below one update. On one machine a
resumed run still repeats an uninterrupted one bit for bit (tests/test_delayed.py and the other
resume tests check that with array_equal). A wrong restore moves the numbers by far more than 1e-6:
test_a_wrong_restore_fails_the_comparison forgets one part of the restored state and requires a
mismatch.

Known limit (measured with XLA:CPU limited to SSE4.2 on every mode of both fixtures): the logged
values and held-out metrics stay within 4e-7, and the MLP, CNN and int8 parameters within the
tolerance, but in the GPT modes without int8 the attention's key bias (16 of the 48 qkv biases
per block) differs by up to 2.4e-4 (1.1e-3 with int4 local steps), and powersgd's embedding in
48 values: the key bias has no gradient in exact arithmetic (a constant added to every key's
score leaves the softmax unchanged), so its gradient is rounding noise, which Adam's normalisation
turns into steps of up to lr: `mismatches` checks it finite and compares the query and value biases.
powersgd's embedding (a slow test) still differs on such a CPU; the fixtures were made on an AVX2 machine.

Amplifiers (measured on an AMD EPYC with AVX-512, 2026-11-26, where the matrix products and
convolutions run in library kernels whose blocking follows the CPU's caches, so even
--xla_cpu_max_isa=AVX2 gave the same numbers): where the arithmetic turns one ulp into more, the
relative tolerance is `AMPLIFIED`'s. gpt_bf16 (the compute rounded to bf16) ended with its
held-out loss 1.9e-5 and a few parameters up to 4.6e-4 off; int8_ring (a quantization level
flipped) two logged grad norms 3.9e-6 and one head weight 4.7e-4 off; powersgd 48 embedding values
up to 2.0e-2 off. A wrong restore moves them by far more: with the optimizer state lost, these
tolerances still found 26 mismatches in gpt_bf16 (step 8's loss 1.4e-3 off), 23 in int8_ring and 15
in powersgd (embedding values up to 1.09 relative off).
The CNN's convolution biases come before BatchNorm, so they get no gradient in exact arithmetic
(like the key bias above): checked finite.

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
from jaxdp.checkpoint.checkpointer import Checkpointer
from jaxdp.config import parse_args
from jaxdp.train import train

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODES = {
    "checkpoints_7a73a05": ["psum", "powersgd", "local_steps", "zero1", "gpt"],
    "checkpoints_f0dd332": ["int8_ring", "overlap", "local_int4_overlap", "zero1_psum", "cnn", "gpt_bf16"],
}
MISSING = "<not logged>"
REL, FLOOR = 1e-6, 1e-8  # relative tolerance; absolute floor for values near 0 (see the docstring)
# Modes whose arithmetic turns a last-place difference into a larger one (the docstring's "Amplifiers"):
# bf16 rounds the compute to 8 bits, int8 quantization flips a level, PowerSGD's low-rank factors move.
AMPLIFIED = {"gpt_bf16": 1e-3, "int8_ring": 1e-3, "powersgd": 3e-2}
EXACT = {"step", "round", "round_steps_by_process", "comm_bytes"}  # counts, also where logged as floats

# Seconds per resume, one process on a 2-core machine shared with other work (load average 10 to 35):
# cold compile cache, all modes: 7a73a05 psum 106, powersgd 142, local_steps 65, zero1 121, gpt 67;
# f0dd332 int8_ring 48, overlap 44, local_int4_overlap 68, zero1_psum 27, cnn 29, gpt_bf16 34 (an
# earlier cold run at lower load: 7a73a05 psum 12, powersgd 20, local_steps 7, zero1 17, gpt 8).
# Warm cache, the fast subset: local_steps 9, gpt 6, overlap 5, cnn 4. Two per fixture stay in it.
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
    """Every way a resumed run's logged steps, held-out metrics and final parameters fail the
    fixture's (empty: it continued as the old code did)."""
    out, rel = [], AMPLIFIED.get(expected.get("mode"), REL)
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
    for name in sorted(set(params) & set(stored)):
        got, want = params[name], stored[name]
        if (got.dtype, got.shape) != (want.dtype, want.shape):
            out.append(f"{name}: {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}")
            continue
        if re.search(r"qkv_\d+\.bias$", name) and want.shape[:1] == (3,):
            # The attention's key bias gets no gradient in exact arithmetic (it adds a constant to every
            # key's score, which the softmax ignores): its trajectory is rounding noise that Adam scales
            # up to lr-sized steps, so it differs across CPUs. Checked finite; the query and value biases
            # are compared like everything else.
            if not np.isfinite(got[1]).all():
                out.append(f"{name}: the key bias is not finite")
            got, want = np.delete(got, 1, axis=0), np.delete(want, 1, axis=0)
        if re.fullmatch(r"Conv_\d+\.bias", name):
            # A convolution's bias before BatchNorm gets no gradient in exact arithmetic either (the
            # normalisation subtracts every constant): rounding noise, checked finite.
            if not np.isfinite(got).all():
                out.append(f"{name}: the bias before BatchNorm is not finite")
            continue
        bad = ~np.isclose(got, want, rtol=rel, atol=FLOOR)
        if bad.any():
            worst = np.max(np.abs(got.astype(np.float64) - want)[bad] / np.maximum(np.abs(want[bad]), FLOOR))
            out.append(f"{name}: {np.count_nonzero(bad)} of {want.size} values differ, by up to {worst:.3g} relative")
    return out


def resume(fixture: str, mode: str, where: Path):
    """Resume the fixture's step-K checkpoint (a copy, in `where`) up to step N with the flags it
    was made with. Returns (the run's result, the metrics file's "start" records)."""
    expected = expected_of(fixture, mode)
    k, n = expected["K"], expected["N"]
    shutil.copytree(FIXTURES / fixture / mode / "ckpt", where / "ckpt")
    shutil.copy(FIXTURES / fixture / "corpus.txt", where / "corpus.txt")
    with contextlib.chdir(where):
        result = train(parse_args([*expected["flags"], "--steps", str(n), "--checkpoint-dir", "ckpt", "--save-every",
                                   str(k), "--keep", "1", "--log-every", "1", "--no-progress", "--metrics-file",
                                   "m.jsonl"]))
    return result, [r for r in records(where / "m.jsonl") if r.get("event") == "start"]


@pytest.mark.parametrize("fixture, mode", CASES)
def test_an_old_checkpoint_resumes_and_continues_to_the_same_numbers(tmp_path, fixture, mode):
    expected = expected_of(fixture, mode)
    result, start = resume(fixture, mode, tmp_path)
    # Resumed from the fixture's step K, not a fresh run.
    assert len(start) == 1 and start[0]["resumed_from"] == expected["K"], start
    assert int(result.state.step) == expected["N"]
    problems = mismatches(result.history, result.summary, flat(result.state.params), expected,
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
    result, start = resume(fixture, mode, tmp_path)
    assert start[0]["resumed_from"] == expected["K"]  # the step count was restored: only `part` is wrong
    problems = mismatches(result.history, result.summary, flat(result.state.params), expected,
                          stored_params(fixture, mode))
    assert problems
    if part == "model_state":  # BatchNorm's running statistics are read by the evaluation only
        assert all(p.startswith("eval_") for p in problems), problems


def test_the_comparison_takes_one_ulp_and_refuses_more_than_its_tolerance():
    """`mismatches` on the fixture's own numbers (no JAX run): 1 ulp off passes, what a wrong
    restore does (a relative 1e-5, a step, a round, a byte count) fails."""
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

    first = expected["steps"][0]
    for key, wrong in [("loss", first["loss"] * (1 + 1e-5)), ("step", first["step"] + 1), ("round", first["round"] + 1),
                       ("comm_bytes", first["comm_bytes"] + 1.0), ("round_steps_by_process", [3])]:
        bad = [{**first, key: wrong}, *expected["steps"][1:]]
        assert mismatches(bad, eval_, stored, expected, stored), key
    assert mismatches(expected["steps"], {**eval_, "eval_loss": eval_["eval_loss"] * (1 - 1e-5)}, stored, expected, stored)
    assert mismatches(expected["steps"], {}, stored, expected, stored)  # a held-out metric not logged
    name = sorted(stored)[0]
    for wrong in (stored[name] * np.float32(1 + 1e-5), stored[name].astype(np.float64), stored[name][:-1]):
        assert mismatches(expected["steps"], eval_, {**stored, name: wrong}, expected, stored), wrong.dtype


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86-64 instruction set")
def test_the_comparison_holds_on_another_x86_64_instruction_set(tmp_path):
    """The 7a73a05 psum fixture resumed in a process whose XLA:CPU may use SSE4.2 only (no AVX, no
    FMA), as on an older x86-64 CPU: its numbers are not the fixture's bit for bit, and pass."""
    fixture, mode = "checkpoints_7a73a05", "psum"
    script = ("import json, sys, numpy as np; import test_checkpoint_compat as t; from pathlib import Path; "
              "where = Path(sys.argv[1]); result, _ = t.resume(sys.argv[2], sys.argv[3], where); "
              "(where / 'got.json').write_text(json.dumps({'history': result.history, 'summary': result.summary}, "
              "default=float)); np.savez(where / 'got.npz', **t.flat(result.state.params))")
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_cpu_max_isa"))
    env = {**os.environ, "XLA_FLAGS": f"{flags} --xla_cpu_max_isa=SSE4_2".strip(),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path), fixture, mode], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads((tmp_path / "got.json").read_text())
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
