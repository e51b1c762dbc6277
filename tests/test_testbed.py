"""The slow-network testbed (jaxdp/bench/testbed.py) and gloo's network interface (jaxdp/cluster/gloo.py).

Real network namespaces, veth links and `tc`, as root; without root or iproute2 these tests skip
with the testbed's own one-line reason. The multi-process tests run `python -m jaxdp.train` on two
hosts of a testbed with no /etc/hosts entry for them: the host name resolves to 127.0.0.1 (or
127.0.1.1), which is exactly what made JAX's gloo advertise an address the other host cannot reach.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import ROOT, cli_env, records, run_cli, step_records
from jaxdp.bench import testbed
from jaxdp.bench.slowlink import run_training
from jaxdp.bench.testbed import Testbed, TestbedError
from jaxdp.cluster import gloo
from jaxdp.config import ConfigError
from jaxdp.errors import EXIT_BAD_INPUT

needs_testbed = pytest.mark.skipif(testbed.unavailable_reason() is not None,
                                   reason=testbed.unavailable_reason() or "")

# Few steps, a small batch (the same global batch in both runs compared).
RUN = ["--dataset", "digits", "--steps", "6", "--batch-size", "64", "--log-every", "1", "--peer-timeout", "30"]


def namespaces() -> set[str]:
    try:
        return set(os.listdir("/var/run/netns"))
    except FileNotFoundError:
        return set()


def in_namespace(bed: Testbed, host: int, code: str) -> str:
    """Run a Python snippet on `host`; its stdout."""
    proc = bed.run(host, [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    return out


# ---------------------------------------------------------------------------------------------
# Pure pieces
# ---------------------------------------------------------------------------------------------


def test_rates_in_tc_syntax():
    assert testbed.parse_rate("100mbit") == 100_000_000
    assert testbed.parse_rate("1gbit") == testbed.parse_rate("1000mbit") == 10**9
    assert testbed.parse_rate("2.5kbit") == 2500
    for bad in ("100", "fast", "0mbit", "10mbps"):
        with pytest.raises(TestbedError, match="is not a bandwidth like 10mbit"):
            testbed.parse_rate(bad)


def test_bad_gloo_interface_names_the_flag_and_the_interfaces_there_are():
    names = gloo.interfaces()
    assert "lo" in names
    with pytest.raises(ConfigError) as err:
        gloo.requested("nosuch0", environ={})
    message = str(err.value)
    assert message.startswith("--gloo-interface='nosuch0' is not a network interface of this machine")
    assert ", ".join(names) in message and "\n" not in message
    with pytest.raises(ConfigError, match=f"^{gloo.ENV_TORCH_INTERFACE}='eth0,eth1' names several interfaces"):
        gloo.requested(None, environ={gloo.ENV_TORCH_INTERFACE: "eth0,eth1"})
    # The flag first, then jaxdp's variable, then PyTorch's.
    env = {gloo.ENV_INTERFACE: "lo", gloo.ENV_TORCH_INTERFACE: "nosuch0"}
    assert gloo.requested(None, environ=env) == ("lo", gloo.ENV_INTERFACE)
    assert gloo.requested("hostname", environ=env) == ("hostname", "--gloo-interface")
    assert gloo.requested(None, environ={gloo.ENV_TORCH_INTERFACE: "lo"}) == ("lo", gloo.ENV_TORCH_INTERFACE)
    assert gloo.requested(None, environ={}) is None


def test_a_coordinator_on_this_machine_keeps_jax_s_default():
    for address in ("127.0.0.1:1234", "localhost:1234"):
        endpoint = gloo.choose(address, environ={})
        assert endpoint.jax_default and "is on this machine" in endpoint.reason
    forced = gloo.choose("127.0.0.1:1234", "lo", environ={})
    assert (forced.interface, forced.address, forced.reason) == ("lo", "127.0.0.1", "--gloo-interface=lo")


def test_cli_rejects_a_bad_gloo_interface_with_one_line():
    proc = run_cli("--steps", "1", "--gloo-interface", "nosuch0", "--no-progress")
    assert proc.returncode == EXIT_BAD_INPUT
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("jaxdp: error: --gloo-interface='nosuch0' is not a network interface"), proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# The testbed itself
# ---------------------------------------------------------------------------------------------


@needs_testbed
def test_testbed_links_its_hosts_shapes_them_and_deletes_everything():
    before = namespaces()
    with Testbed(num_hosts=3, rate="100mbit") as bed:
        made = namespaces() - before
        assert made == {bed.namespace(i) for i in range(3)} | {f"{bed.tag}-br"}
        assert [bed.address(i) for i in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
        # Host 2 reaches hosts 0 and 1 over TCP, and its own lo is up.
        server = bed.run(0, [sys.executable, "-c", "import socket; s = socket.create_server(('10.77.0.1', 5000)); "
                             "c, a = s.accept(); c.sendall(a[0].encode())"], stdout=subprocess.PIPE, text=True)
        out = in_namespace(bed, 2, "import socket, time\n"
                           "for _ in range(100):\n"
                           "    try: c = socket.create_connection(('10.77.0.1', 5000)); break\n"
                           "    except OSError: time.sleep(0.05)\n"
                           "print(c.recv(100).decode())\n"
                           "s = socket.create_server(('127.0.0.1', 0)); socket.create_connection(s.getsockname())\n"
                           "from jaxdp.cluster import gloo; print(gloo.choose('10.77.0.2:1').describe())\n"
                           "from jaxdp.elastic import ft; env = {}\n"
                           "print(ft.advertised_host('http://10.77.0.2:1', env), env, ft.advertised_host('127.0.0.1:1'))")
        assert out.splitlines()[0] == "10.77.0.3"
        assert out.splitlines()[1].startswith("gloo collectives on eth0 (10.77.0.3): the interface that reaches "
                                              "the coordinator 10.77.0.2")
        # A torchft worker announces the address that reaches the Lighthouse, and torch's gloo listens there.
        assert out.splitlines()[2] == "10.77.0.3 {'GLOO_SOCKET_IFNAME': 'eth0'} 127.0.0.1"
        server.wait(timeout=10)
        # Both ends of every link carry the token bucket at the rate asked for.
        for ns, dev in ((bed.namespace(1), testbed.HOST_IFNAME), (f"{bed.tag}-br", "h1")):
            qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "rate 100Mbit" in qdisc, qdisc
        sleeper = bed.run(1, ["sleep", "600"])
    assert sleeper.returncode is not None  # killed at teardown
    assert namespaces() == before


@needs_testbed
def test_the_link_counters_see_what_a_host_sends():
    """2 MB from host 0 to host 1: host 0's counter grows by the payload and its headers (under 5 %
    here: segments are large on a veth), host 1's by its acknowledgements only."""
    with Testbed(num_hosts=2, rate="1gbit") as bed:
        server = bed.run(1, [sys.executable, "-c", "import socket; s = socket.create_server(('10.77.0.2', 5000)); "
                             "c, _ = s.accept()\nwhile c.recv(1 << 16): pass"])
        before = bed.sent_bytes()
        in_namespace(bed, 0, "import socket, time\n"
                     "for _ in range(100):\n"
                     "    try: c = socket.create_connection(('10.77.0.2', 5000)); break\n"
                     "    except OSError: time.sleep(0.05)\n"
                     "c.sendall(b'x' * 2_000_000); c.close()")
        server.wait(timeout=10)
        after = bed.sent_bytes()
    sent = [b - a for a, b in zip(before, after)]
    assert 2_000_000 < sent[0] < 2_100_000 and sent[1] < 100_000, sent


def test_wire_bytes_per_step_is_the_counters_between_the_first_and_last_logged_steps():
    from jaxdp.bench.slowlink import Training

    # (last logged step, bytes each host has sent): start-up traffic before step 10, then 1,000 and
    # 3,000 bytes a step, the final evaluation's after step 50 (not counted); the first sample of
    # a step is when its record appeared
    wire = [(0, [500, 900]), (0, [800, 1200]), (10, [1000, 2000]), (10, [1100, 2100]), (30, [21000, 62000]),
            (50, [41000, 122000]), (50, [41500, 122500]), (50, [90000, 190000])]
    assert Training([], 0.0, [0, 0], ["", ""], wire).wire_bytes_per_step() == (1000 + 3000) / 2
    assert Training([], 0.0, [0, 0], ["", ""], [(0, [1, 1]), (5, [2, 2])]).wire_bytes_per_step() is None


@needs_testbed
def test_testbed_cleans_up_after_an_error_and_says_what_it_cannot_do():
    before = namespaces()
    with pytest.raises(RuntimeError, match="inside"):
        with Testbed(num_hosts=2) as bed:
            qdisc = subprocess.run(["tc", "-n", bed.namespace(0), "qdisc", "show", "dev", "eth0"],
                                   capture_output=True, text=True).stdout
            assert "tbf" not in qdisc  # rate None: unshaped
            raise RuntimeError("inside")
    assert namespaces() == before
    if testbed.has_netem():
        with Testbed(num_hosts=2, rate="10mbit", latency="5ms") as bed:
            qdisc = subprocess.run(["tc", "-n", bed.namespace(0), "qdisc", "show", "dev", "eth0"],
                                   capture_output=True, text=True).stdout
            assert "netem" in qdisc and "tbf" in qdisc, qdisc
    else:
        with pytest.raises(TestbedError, match="needs the netem qdisc, which this kernel lacks"):
            with Testbed(num_hosts=2, latency="5ms"):
                pass
    assert namespaces() == before


# ---------------------------------------------------------------------------------------------
# Two hosts: jaxdp.train over the testbed's network, with no /etc/hosts help.
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@needs_testbed
def test_two_hosts_train_like_one_process_on_the_same_global_batch(tmp_path):
    """Process 0 takes its interface from JAXDP_GLOO_INTERFACE, process 1 finds it by itself."""
    one = subprocess.Popen([sys.executable, "-m", "jaxdp.train", *RUN, "--strategy", "ring", "--devices", "2",
                            "--no-progress", "--metrics-file", str(tmp_path / "one.jsonl")], cwd=ROOT, env=cli_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with Testbed(num_hosts=2, rate="1gbit") as bed:
        two = run_training(bed, [*RUN, "--strategy", "ring", "--debug"], devices=1, timeout=180,
                           process_env=[{gloo.ENV_INTERFACE: "eth0"}, {}])
    assert one.wait(timeout=180) == 0, one.stderr.read()[-2000:]
    assert two.ok, f"{two.returncodes}\n{two.outputs[0][-3000:]}\n{two.outputs[1][-3000:]}"
    assert f"gloo collectives on eth0 (10.77.0.1): {gloo.ENV_INTERFACE}=eth0" in two.outputs[0]
    assert ("gloo collectives on eth0 (10.77.0.2): the interface that reaches the coordinator 10.77.0.1"
            in two.outputs[1])
    ref = step_records(tmp_path / "one.jsonl")
    assert [r["step"] for r in two.steps()] == [r["step"] for r in ref] == list(range(1, 7))
    np.testing.assert_allclose([r["loss"] for r in two.steps()], [r["loss"] for r in ref], rtol=1e-5)
    done, ref_done = two.records[-1], records(tmp_path / "one.jsonl")[-1]
    assert done["event"] == "done" and done["processes"] == 2 and done["devices"] == ref_done["devices"] == 2
    np.testing.assert_allclose(done["eval_loss"], ref_done["eval_loss"], rtol=1e-5)
    assert done["eval_accuracy"] == ref_done["eval_accuracy"]


@pytest.mark.slow
@pytest.mark.multiprocess
@needs_testbed
def test_jax_s_own_address_choice_is_refused_across_hosts(tmp_path):
    """`--gloo-interface hostname` keeps JAX's choice: the host name's address, 127.0.0.1 here, which
    the other host cannot reach. Seeing the refusal is enough: the processes are killed then."""
    if not ipaddress.ip_address(socket.gethostbyname(socket.gethostname())).is_loopback:
        pytest.skip("this machine's host name does not resolve to a loopback address")
    with Testbed(num_hosts=2) as bed:
        flags = [*RUN, "--devices", "1", "--no-progress", "--gloo-interface", "hostname"]
        logs = [tmp_path / f"p{i}.err" for i in range(2)]
        procs = []
        for i in range(2):
            with open(logs[i], "w") as err:
                procs.append(bed.run(i, [sys.executable, "-m", "jaxdp.train", *flags, "--coordinator-address",
                                         f"{bed.address(0)}:12355", "--num-processes", "2", "--process-id", str(i)],
                                     env=cli_env(), stdout=subprocess.DEVNULL, stderr=err))
        deadline = time.monotonic() + 120
        text = ""
        while "Connection refused" not in text and time.monotonic() < deadline:  # gloo retries, then JAX gives up
            time.sleep(0.2)  # the refusal is a log line of a process that may hang afterwards: poll its file
            text = "".join(log.read_text(errors="replace") for log in logs)
            if all(p.poll() is not None for p in procs):
                text = "".join(log.read_text(errors="replace") for log in logs)
                break
    assert "Connection refused" in text and "remote=[127.0.0.1]" in text, text[-3000:]


@pytest.mark.slow
@pytest.mark.multiprocess
@needs_testbed
def test_auto_compression_compresses_on_a_slow_link():
    """--compression auto on a 100 Mbit/s link: the all-reduce it measures dominates the step, so it
    compresses, says why in the metrics file, and the run trains through the ring on both hosts."""
    with Testbed(num_hosts=2, rate="100mbit") as bed:
        run = run_training(bed, ["--dataset", "digits", "--steps", "4", "--batch-size", "64", "--log-every", "2",
                                 "--strategy", "ring", "--compression", "auto", "--peer-timeout", "60"],
                           devices=1, timeout=240)
    assert run.ok, f"{run.returncodes}\n{run.outputs[0][-3000:]}"
    decision = [r for r in run.records if r.get("event") == "compression"][0]
    assert decision["choice"] != "none", decision["why"]
    assert decision["comm_full_s"] > 4 * decision["compute_s"]  # the link, not the model, sets the pace
    steps = run.steps()
    assert [r["step"] for r in steps] == [2, 4]
    assert all(r["compression_ratio"] > 1.5 for r in steps)
    assert run.records[-1]["event"] == "done" and np.isfinite(run.records[-1]["eval_loss"])


@needs_testbed
def test_cpu_holds_a_process_to_its_fraction_of_a_core():
    """`run(..., cpu=0.5)`: the process is in a cgroup of the testbed's whose quota is half its
    period (or, without a writable cpu controller, shares its core with one busy loop); removed at
    teardown. A fraction outside (0, 1] is refused."""
    with Testbed(num_hosts=2) as bed:
        with pytest.raises(TestbedError, match="fraction of one core"):
            bed.run(0, ["true"], cpu=1.5)
        proc = bed.run(1, [sys.executable, "-c", "import time; time.sleep(30)"], cpu=0.5)
        time.sleep(0.5)  # `ip netns exec` replaces itself with python: the pid stays
        kind = testbed.cpu_limit_kind()
        if kind == "cgroup v1":
            group = f"/sys/fs/cgroup/cpu/{bed.tag}-h1"
            assert f"cpu:/{bed.tag}-h1" in open(f"/proc/{proc.pid}/cgroup").read()
            assert int(open(f"{group}/cpu.cfs_quota_us").read()) * 2 == int(open(f"{group}/cpu.cfs_period_us").read())
        else:
            assert kind == "cgroup v2" or len(bed._hogs) == 1
    assert kind != "cgroup v1" or not os.path.exists(group)


@needs_testbed
@pytest.mark.slow  # 2 variants, unshaped and shaped: about 20 s on 2 cores
def test_plan_validate_predicts_each_variant_from_its_unshaped_run(tmp_path):
    out = tmp_path / "v.json"
    variants = "--strategy ring;--sync-every 4 --outer-optimizer sgd --outer-lr 1 --outer-momentum 0"
    proc = run_cli("plan", "--validate", "--rate", "100mbit", "--steps", "20", "--log-every", "5", "--variants",
                   variants, "--json", str(out), module="jaxdp.bench")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["variant"], r["sync_every"]) for r in rows] == [(v, h) for v, h in zip(variants.split(";"), (1, 4))]
    for r in rows:
        assert r["bytes_per_sync"] > 0 and r["measured_steps_per_s"] > 0
        # the bucket only ever shortens the cost model's prediction
        assert r["bucket_steps_per_s"] >= r["predicted_steps_per_s"]
        assert r["error"] == pytest.approx(r["predicted_steps_per_s"] / r["measured_steps_per_s"] - 1)
    assert "median |error|" in proc.stdout


def test_localsgd_takes_an_earlier_synchronous_run_only_of_the_same_training_flags(tmp_path):
    """`--synchronous-from`: the synchronous row and its rate from an earlier JSON; one line (a
    SystemExit) for a file without one, or one that ran other training flags."""
    import json

    from jaxdp.bench.localsgd import earlier_synchronous

    flags = ["--model", "gpt", "--dataset", "corpus.txt", "--steps", "400"]
    row = {"run": "synchronous", "curve": [[400, 12.5, 2.25]], "wire_bytes_per_step": 572857}
    path = tmp_path / "sync.json"
    path.write_text(json.dumps({"results": [row], "rate": "unshaped", "train_flags": flags}))
    assert earlier_synchronous(str(path), flags) == (row, "unshaped")
    with pytest.raises(SystemExit, match="ran other training flags"):
        earlier_synchronous(str(path), [*flags[:-1], "800"])
    path.write_text(json.dumps({"results": [{**row, "run": "H=16"}], "train_flags": flags}))
    with pytest.raises(SystemExit, match="has no synchronous run"):
        earlier_synchronous(str(path), flags)
    with pytest.raises(SystemExit, match="--synchronous-from"):
        earlier_synchronous(str(tmp_path / "missing.json"), flags)
