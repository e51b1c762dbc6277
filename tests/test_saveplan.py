"""--save-every auto: the interval chosen from the measured save cost (jaxdp/checkpoint/saveplan.py), the
checkpointer's measuring save, the recall after a restart, and the launcher's failure record."""

import json
import math
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT, cli_env, commands, readme_blocks, records, saved
from jaxdp.checkpoint import saveplan
from jaxdp.checkpoint.saveplan import SavePlan
from jaxdp.config import ConfigError, parse_args
from jaxdp.train import train


def test_a_fixed_interval_is_due_at_its_multiples_also_across_a_paced_round():
    plan = SavePlan(5)
    assert [step for step in range(1, 16) if plan.due(step - 1, step)] == [5, 10, 15]
    assert plan.due(3, 7) and not plan.due(5, 9) and plan.due(9, 23)  # a round that passes 10 (and 20): one save
    assert not any(SavePlan(0).due(s - 1, s) for s in range(1, 50))


def test_auto_measures_at_a_fixed_step_then_saves_every_n_from_there():
    plan = SavePlan("auto")
    assert not plan.due(0, 1)  # the first call (after the compiling step) starts the clock
    probe = 1 + saveplan.PROBE_AFTER
    assert [s for s in range(2, 200) if plan.due(s - 1, s)] == [probe]  # nothing before the decision but the probe
    assert plan.probing(probe) and not plan.probing(probe - 1)
    plan.decide(probe, step_s=0.01, blocked_s=0.02, written_s=0.1)
    assert plan.every == math.ceil(0.02 / (saveplan.OVERHEAD * 0.01)) == 200  # 1 % of the training time
    assert not plan.probing(probe + 5)
    assert [s for s in range(probe + 1, probe + 700) if plan.due(s - 1, s)] == [probe + 200, probe + 400, probe + 600]


def test_auto_after_failures_takes_youngs_interval_and_never_lets_writes_queue():
    young = SavePlan("auto", restarts=3, mtbf_s=10.0)
    young.decide(50, step_s=0.004, blocked_s=0.02, written_s=0.1)
    assert young.every == math.ceil(math.sqrt(2 * 0.02 * 10.0) / 0.004) == 159
    assert "Young" in young.decision["why"] and "3 restarts" in young.decision["why"]
    slow_write = SavePlan("auto", restarts=1, mtbf_s=1.0)
    slow_write.decide(50, step_s=0.01, blocked_s=0.001, written_s=2.0)  # a 2 s write: never two in flight
    assert slow_write.every == 200 and "background write" in slow_write.decision["why"]


def test_the_failure_record_comes_from_the_launchers_environment():
    assert saveplan.failures_from_env({}) == (0, None)
    assert saveplan.failures_from_env({saveplan.ENV_RESTARTS: "2", saveplan.ENV_MTBF: "12.5"}) == (2, 12.5)
    assert saveplan.failures_from_env({saveplan.ENV_RESTARTS: "x"}) == (0, None)
    assert saveplan.mtbf(100.0, []) is None and saveplan.mtbf(100.0, [110.0, 130.0]) == 15.0


@pytest.mark.parametrize("value", ["soon", "-3"])
def test_a_bad_save_every_is_one_line(value):
    with pytest.raises(ConfigError, match="--save-every must be a number of steps .* or auto"):
        parse_args(["--save-every", value])


@pytest.mark.slow  # over 4 s on 2 cores
def test_auto_run_saves_at_the_probe_and_every_n_then_a_restart_decides_from_the_recorded_cost(tmp_path, monkeypatch):
    (block,) = readme_blocks("tests/test_saveplan.py::"
                             "test_auto_run_saves_at_the_probe_and_every_n_then_a_restart_decides_from_the_recorded_cost")
    (command,) = commands(block)  # docs/checkpoints.md's, run in this process
    assert command.startswith("python -m jaxdp.train ") and "--steps 60" in command
    monkeypatch.chdir(tmp_path)
    flags = ["--log-every", "5", "--no-progress", *shlex.split(command)[3:]]
    train(parse_args(flags))
    (chosen,) = [r for r in records(tmp_path / "run.jsonl") if r.get("event") == "save_every"]
    probe, every = chosen["from_step"], chosen["save_every"]
    assert probe == 1 + saveplan.PROBE_AFTER and not chosen["recalled"] and chosen["mtbf_s"] is None
    assert every == max(math.ceil(chosen["written_s"] / chosen["step_s"]),
                        math.ceil(chosen["blocked_s"] / (saveplan.OVERHEAD * chosen["step_s"])))
    expected = sorted({*range(probe, 61, every), 60})
    assert sorted(map(int, saved(tmp_path / "ckpt")))[-3:] == expected[-3:]  # (keep = 3)
    meta = json.loads((tmp_path / "ckpt" / "60" / "meta" / "metadata").read_text())
    assert meta["save_cost"] == {k: chosen[k] for k in saveplan.COSTS} | {"devices": 8}

    # Restarted by the launcher after 2 failures, 0.3 s apart on average: no measuring save, Young's
    # interval from the costs the checkpoint recorded.
    monkeypatch.setenv(saveplan.ENV_RESTARTS, "2")
    monkeypatch.setenv(saveplan.ENV_MTBF, "0.3")
    train(parse_args([*flags, "--steps", "130"]))  # (the last --steps wins)
    recalled = [r for r in records(tmp_path / "run.jsonl") if r.get("event") == "save_every"][-1]
    assert recalled["recalled"] and recalled["from_step"] == 60 and recalled["mtbf_s"] == 0.3
    young = max(math.ceil(chosen["written_s"] / chosen["step_s"]),
                math.ceil(math.sqrt(2 * chosen["blocked_s"] * 0.3) / chosen["step_s"]))
    assert recalled["save_every"] == young
    assert sorted(map(int, saved(tmp_path / "ckpt")))[-3:] == sorted({*range(60, 131, young), 130})[-3:]


def test_the_launcher_tells_a_restarted_process_its_failure_record():
    child = ("import os, sys\n"
             "restarts = os.environ['JAXDP_RESTARTS']\n"
             "if restarts == '0': sys.exit(69)  # lost: the launcher restarts it\n"
             "print('record', restarts, float(os.environ['JAXDP_MTBF_S']) >= 0)\n")
    done = subprocess.run([sys.executable, "-m", "jaxdp.launch", "--nproc-per-node", "1", "--max-restarts", "1",
                           "--no-bind", "--", sys.executable, "-c", child], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "record 1 True" in done.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_save_at_the_steps_process_0_chose(tmp_path):
    # Each process measures its own save; they must still save at the same steps (orbax saves are
    # collective): process 0's measurements decide for both.
    from helpers import free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "jaxdp.train", "--coordinator-address", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i), "--devices", "2", "--no-progress",
                               "--steps", "60", "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "auto",
                               "--metrics-file", str(tmp_path / f"m{i}.jsonl")],
                              cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        errs = [p.communicate(timeout=180)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], errs
    (chosen,) = [r for r in records(tmp_path / "m0.jsonl") if r.get("event") == "save_every"]
    assert [line.startswith("jaxdp: --save-every auto: every ") for line in errs[0].splitlines()].count(True) == 1
    assert "--save-every auto" not in errs[1]  # one line, from process 0
    probe, every = chosen["from_step"], chosen["save_every"]
    assert sorted(map(int, saved(tmp_path / "ckpt")))[-3:] == sorted({*range(probe, 61, every), 60})[-3:]
