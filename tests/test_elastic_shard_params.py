"""`--shard-params` across torchft workers: the every-step rule of jaxdp/elastic/every_step.py on
`--shard-params`'s layout inside each worker (parameters, gradients and optimizer state cut over its
devices, jaxdp/step/fsdp.py), with no step program of its own. Real worker processes and a real
Lighthouse: undisturbed, the run's losses are a static mesh's over the same devices (one process,
`--shard-params`); a worker killed and healed takes the cut state from a live peer and the run ends
with the undisturbed run's parameters, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import ROOT, cli_env  # noqa: E402

pytest.importorskip("torchft", reason="pip install -e '.[elastic]'")
from test_elastic_ft import PY, Run, finish, kill_1_and_rejoin  # noqa: E402

SHARDED = ("--shard-params",)


def losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())
            if "loss" in r and r.get("event") is None}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_workers_of_two_devices_with_cut_state_train_as_a_static_mesh_of_four(tmp_path):
    steps = 40
    finish(Run(tmp_path, steps, train_args=SHARDED, strategy="psum", devices=2))
    reference = subprocess.run([PY, "-m", "jaxdp.train", "--shard-params", "--strategy", "psum", "--devices", "4",
                                "--steps", str(steps), "--no-progress", "--log-every", "1",
                                "--metrics-file", str(tmp_path / "static.jsonl")],
                               cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr
    elastic, static = losses(tmp_path / "ckpt.jsonl"), losses(tmp_path / "static.jsonl")
    assert sorted(elastic) == sorted(static) == list(range(1, steps + 1))
    assert max(abs(elastic[s] - static[s]) / abs(static[s]) for s in static) < 1e-6, (elastic, static)
    records = [json.loads(line) for line in (tmp_path / "ckpt.jsonl").read_text().splitlines()]
    assert records[-1].get("event") == "done" and records[-1].get("eval_accuracy") is not None
    sent = [r["comm_bytes"] for r in records if "comm_bytes" in r]  # (the whole run's devices, not one worker's: 0)
    assert sent and min(sent) > 0 and sent == [sent[0]] * len(sent)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_worker_with_cut_state_killed_heals_from_a_live_one_and_ends_as_the_undisturbed_run(tmp_path):
    steps = 2000  # rank 1's restart must come back before rank 0, alone, ends
    kill_1_and_rejoin(Run(tmp_path, steps, "--max-restarts", "10", train_args=SHARDED, strategy="psum", devices=2))
    finish(Run(tmp_path, steps, train_args=SHARDED, strategy="psum", devices=2, name="calm"))
    final = [json.loads((tmp_path / d / str(steps) / "jaxdp_checksums.json").read_text()) for d in ("ckpt", "calm")]
    assert final[0] == final[1] and any(k.startswith("params") for k in final[0])
