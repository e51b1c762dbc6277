"""Checkpoints written by jaxdp at commit 7a73a05 resume with today's code and continue bit-identically.

tests/fixtures/checkpoints_7a73a05/<mode>/ holds, per mode (see make.py there for how it was made,
by the OLD code): ckpt/ (the step-K checkpoint and its config.toml), expected.json (the flags, K, N,
every logged value of steps K+1..N of an uninterrupted run, the final held-out metrics) and
params.npz (that run's final parameters). Each test resumes a copy of ckpt/ with the same flags up
to step N and requires the same numbers with ==, and the same parameter bytes.

The runs name their paths relative to the working directory (the checkpoints record
`--dataset corpus.txt`, and a resumed run must give the same --dataset): each test runs in a
tmp_path holding copies of ckpt/ and corpus.txt, and passes every path on the command line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import records
from jaxdp.config import parse_args
from jaxdp.train import train

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoints_7a73a05"
MODES = ["psum", "powersgd", "local_steps", "zero1", "gpt"]
MISSING = "<not logged>"


def expected_of(mode: str) -> dict:
    return json.loads((FIXTURE / mode / "expected.json").read_text())


def flat(tree) -> dict[str, np.ndarray]:
    """Leaves by tree path joined with "." (the keys of params.npz)."""
    def name(path):
        return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
    return {name(p): np.asarray(jax.device_get(x)) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# Cold compile cache, one process (2-core machine, CPU seconds): psum 10, powersgd 27, local_steps 16,
# zero1 27, gpt 14; with a warm cache each takes 3 to 10 s.
SLOW = {"powersgd", "zero1"}


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in MODES])
def test_checkpoint_of_7a73a05_resumes_and_continues_bit_identically(tmp_path, monkeypatch, mode):
    expected = expected_of(mode)
    k, n = expected["K"], expected["N"]
    shutil.copytree(FIXTURE / mode / "ckpt", tmp_path / "ckpt")
    shutil.copy(FIXTURE / "corpus.txt", tmp_path / "corpus.txt")
    monkeypatch.chdir(tmp_path)

    result = train(parse_args([*expected["flags"], "--steps", str(n), "--checkpoint-dir", "ckpt", "--save-every",
                               str(k), "--keep", "1", "--log-every", "1", "--no-progress", "--metrics-file", "m.jsonl"]))

    # Resumed from the fixture's step K, not a fresh run.
    start = [r for r in records(tmp_path / "m.jsonl") if r.get("event") == "start"]
    assert len(start) == 1 and start[0]["resumed_from"] == k, start
    assert [r["step"] for r in result.history] == list(range(k + 1, n + 1))
    assert int(result.state.step) == n
    # Every value the old code logged for steps K+1..N (timings aside), exactly.
    for got, want in zip(result.history, expected["steps"], strict=True):
        assert {key: got.get(key, MISSING) for key in want} == want, f"step {want['step']}"
    assert {key: result.summary.get(key, MISSING) for key in expected["eval"]} == expected["eval"]
    # The final parameters, bit for bit.
    params = flat(result.state.params)
    with np.load(FIXTURE / mode / "params.npz") as stored:
        assert sorted(params) == sorted(stored.files)
        for name in stored.files:
            got, want = params[name], stored[name]
            assert (got.dtype, got.shape) == (want.dtype, want.shape), name
            assert got.tobytes() == want.tobytes(), (
                f"{name}: {np.count_nonzero(got != want)} of {want.size} values differ, "
                f"largest by {np.max(np.abs(got.astype(np.float64) - want)):.3g}")


def test_the_fixture_holds_what_make_py_says():
    """The checkpoints are the ones the modes need (no JAX: the fixture's own files)."""
    for mode in MODES:
        expected = expected_of(mode)
        k, n = expected["K"], expected["N"]
        ckpt = FIXTURE / mode / "ckpt"
        assert sorted(p.name for p in ckpt.iterdir()) == [str(k), "config.toml"], mode
        assert [r["step"] for r in expected["steps"]] == list(range(k + 1, n + 1)) and 0 < k < n
        assert all(np.isfinite(r["loss"]) for r in expected["steps"]) and expected["eval"]
        meta = json.loads((ckpt / str(k) / "meta" / "metadata").read_text())
        assert meta["step"] == k and meta["devices"] == 8, mode
        described = (ckpt / str(k) / "state" / "_METADATA").read_text()
        if mode == "powersgd":  # per-device error feedback and the shared Q factors were saved
            assert "compression" in described
            assert all(r["compressed"] == 1.0 for r in expected["steps"])
        if mode == "local_steps":  # the replicas, two steps into a period of 4; steps 7..10 cross a sync
            assert "local_sgd" in described and k % 4 != 0
            assert [r["synced"] for r in expected["steps"]] == [float(s % 4 == 0) for s in range(k + 1, n + 1)]
