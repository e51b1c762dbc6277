"""jaxdp.sync.collectives.psum_scatter: XLA's reduce-scatter, except on CPU across processes.

Under jax.distributed on CPU, XLA runs every collective through gloo (even between the devices of
one process), and gloo's reduce-scatter returns wrong values at the end of a chunk of a few MiB, now
and then, with no error (https://github.com/jax-ml/jax/issues/40830). ZeRO-1 over psum and
`--hierarchy auto` reduce-scatter; there jaxdp runs the ring's own reduce-scatter (ppermutes)
instead. Checked against numpy sums on 8 MiB chunks (tests/scripts/reduce_scatter_check.py) and
through the CLI against the flat all-reduce, which never reduce-scatters.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import ROOT, cli_env, free_port, run_cli, step_records
from jaxdp.mesh import DATA_AXIS, make_mesh
from jaxdp.sync.collectives import PSUM


def test_one_process_keeps_xlas_reduce_scatter(devices):
    """In one process there is no gloo: the halves stay XLA's reduce-scatter (and equal the sum)."""
    mesh = make_mesh(devices)
    n = mesh.size
    scatter = jax.jit(jax.shard_map(lambda x: PSUM.halves.reduce_scatter(x[0], DATA_AXIS)[None], mesh=mesh,
                                    in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS)))
    x = np.arange(n * n * 3, dtype=np.float32).reshape(n, n * 3)
    assert "reduce-scatter" in scatter.lower(x).as_text(dialect="hlo")
    np.testing.assert_array_equal(np.asarray(scatter(x)), x.mean(0).reshape(n, 3))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_reduce_scatters_across_processes_equal_numpy_sums():
    """2 processes x 2 devices: PSUM's halves, the hierarchical ones and the hierarchical all-reduce
    emit no XLA reduce-scatter (which gloo would run), and 4 calls each on fresh inputs of 8 MiB
    chunks are bit for bit equal to numpy's (exact) means.
    With gloo's reduce-scatter (f0dd332) this failed in each of 3 runs: the hierarchical halves were
    wrong in 1 to 5 of the 20 calls (16 thousand to 5 million values), the hierarchical all-reduce
    in 0 to 3; the flat PSUM halves never (nor at 16 MiB chunks), but they hand gloo the same
    reduce-scatter."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "scripts" / "reduce_scatter_check.py"), str(i),
                               f"127.0.0.1:{port}", "8", "4"], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:  # a hang leaves no process behind to slow the rest of the suite
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    for out, _ in outs:
        wrong = dict(kv.split("=") for kv in out.splitlines()[-1].split())
        cases = ("psum", "hier", "hier_mean")
        assert wrong["calls"] == "4" and {k: int(wrong[k]) for k in cases} == dict.fromkeys(cases, 0), wrong
        assert {k: int(wrong[f"{k}_hlo"]) for k in cases} == dict.fromkeys(cases, 0), wrong


WIDE = '''
import flax.linen as nn


class Wide(nn.Module):
    """An MLP of 9.5M parameters: 9.5 MiB chunks per device for ZeRO-1's and the hierarchy's
    reduce-scatter, large enough for gloo's to go wrong, and seconds to compile (a GPT: 15 s)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.relu(nn.Dense(3072)(x.reshape(x.shape[0], -1)))
        x = nn.relu(nn.Dense(3072)(x))
        return nn.Dense(10)(x)
'''


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)  # 2 runs of 2 processes and one of 1: a minute or two on a loaded 2-core machine
def test_zero1_over_psum_and_hierarchy_auto_train_like_the_flat_all_reduce(tmp_path):
    """Through the CLI (jaxdp.launch), 2 processes x 2 devices, an MLP of 9.5M parameters, Adam,
    3 steps: ZeRO-1 over psum (with --hierarchy auto, the default) and replicated psum with
    --hierarchy auto equal the all-reduce of one process with the 4 devices, which involves no gloo
    and reduce-scatters nowhere, to 1e-5 in every step's loss. With gloo's reduce-scatter they were
    off by 1.3e-3 to 6.3e-2 (2 runs each; a 9.9M-parameter GPT: up to 4.4e-2 and 5.8e-3)."""
    (tmp_path / "wide.py").write_text(WIDE)
    flags = ["--model", "wide:Wide", "--model-path", str(tmp_path), "--optimizer", "adam", "--steps", "3",
             "--log-every", "1", "--no-progress", "--strategy", "psum"]
    runs = {"zero_psum_auto": ["--shard-optimizer"], "psum_auto": ["--hierarchy", "auto"]}
    for name, more in runs.items():  # one at a time: each launch binds its processes to cores 0 and 1
        proc = run_cli("--nproc-per-node", "2", "--", sys.executable, "-m", "jaxdp.train", *flags, "--devices", "2",
                       *more, "--metrics-file", str(tmp_path / f"{name}.jsonl"), module="jaxdp.launch", timeout=300)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    proc = run_cli(*flags, "--devices", "4", "--metrics-file", str(tmp_path / "one_process.jsonl"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {name: [r["loss"] for r in step_records(tmp_path / f"{name}.jsonl")] for name in [*runs, "one_process"]}
    assert all(len(v) == 3 for v in losses.values()), {k: len(v) for k, v in losses.items()}
    np.testing.assert_allclose(losses["zero_psum_auto"], losses["one_process"], rtol=1e-5)
    np.testing.assert_allclose(losses["psum_auto"], losses["one_process"], rtol=1e-5)
