"""Kubernetes (Indexed Job, JobSet), SkyPilot and dstack detection: pure functions of the environment.

Each platform's variables as its docs say it sets them (one process per node or pod); what detect() makes of
them, what wins when several sources are present, and the one-line errors for what cannot work.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from jaxdp.cluster import detect as cluster
from jaxdp.cluster.detect import CLOUD_PORT, Cluster, detect
from jaxdp.config import Config, ConfigError, parse_args

K8S_POD = {"JOB_COMPLETION_INDEX": "2", "JAX_NUM_PROCESSES": "4", "HOSTNAME": "trainer-2"}
K8S_FQDN = "trainer-2.workers.team-a.svc.cluster.local"
SKYPILOT_NODE = {"SKYPILOT_NODE_IPS": "10.1.0.5\n10.1.0.6\n10.1.0.7\n", "SKYPILOT_NODE_RANK": "1",
                 "SKYPILOT_NUM_GPUS_PER_NODE": "8", "SKYPILOT_TASK_ID": "sky-2026-11-25-run"}
DSTACK_NODE = {"DSTACK_MASTER_NODE_IP": "10.2.0.9", "DSTACK_NODE_RANK": "3", "DSTACK_NODES_NUM": "4",
               "DSTACK_RUN_NAME": "wise-owl-1"}


def test_kubernetes_indexed_job_finds_the_first_pod_by_its_dns_name():
    got = detect(Config(), K8S_POD, fqdn=K8S_FQDN)
    assert got == Cluster("kubernetes", f"trainer-0.workers.team-a.svc.cluster.local:{CLOUD_PORT}", 4, 2)
    assert detect(Config(), {**K8S_POD, "JAX_COORDINATOR_PORT": "7000"}, fqdn=K8S_FQDN).coordinator_address \
        == "trainer-0.workers.team-a.svc.cluster.local:7000"


def test_kubernetes_jobset_pod_names():
    # <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>: the first pod is ...-0-0.
    assert cluster.kubernetes_first_pod("llm-workers-0-13.llm", "llm-workers-0-13", 13) == "llm-workers-0-0.llm"
    assert cluster.kubernetes_first_pod("trainer-10.svc", "trainer-10", 10) == "trainer-0.svc"


def test_kubernetes_explicit_coordinator_and_process_id_win():
    env = {**K8S_POD, "JAX_COORDINATOR_ADDRESS": "head.svc:1234"}
    assert detect(Config(), env, fqdn="ignored") == Cluster("kubernetes", "head.svc:1234", 4, 2)
    # All three JAX_* variables: the environment branch, as under the launcher.
    assert detect(Config(), {**env, "JAX_PROCESS_ID": "1"}).source == "environment"


def test_kubernetes_errors_say_what_to_set():
    with pytest.raises(ConfigError, match="needs JAX_NUM_PROCESSES set to the Job's completions"):
        detect(Config(), {"JOB_COMPLETION_INDEX": "0"}, fqdn=K8S_FQDN)
    with pytest.raises(ConfigError, match="headless Service as their subdomain, or set JAX_COORDINATOR_ADDRESS"):
        detect(Config(), K8S_POD, fqdn="trainer-2")  # no subdomain: pod names do not resolve
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX=4 must be between 0 and JAX_NUM_PROCESSES - 1 = 3"):
        detect(Config(), {**K8S_POD, "JOB_COMPLETION_INDEX": "4", "HOSTNAME": "trainer-4"},
               fqdn="trainer-4.workers")
    assert detect(Config(), {**K8S_POD, "JAX_NUM_PROCESSES": "1", "JOB_COMPLETION_INDEX": "0"}) == Cluster("single")


def test_skypilot_head_node_coordinates():
    got = detect(Config(), SKYPILOT_NODE)
    assert got == Cluster("skypilot", f"10.1.0.5:{CLOUD_PORT}", 3, 1, run_id="skypilot-sky-2026-11-25-run")
    assert detect(Config(), {**SKYPILOT_NODE, "SKYPILOT_NODE_IPS": "10.1.0.5"}) == Cluster("single")
    with pytest.raises(ConfigError, match="SKYPILOT_NODE_RANK=3 must be between 0 and SKYPILOT_NODE_IPS - 1 = 2"):
        detect(Config(), {**SKYPILOT_NODE, "SKYPILOT_NODE_RANK": "3"})


def test_dstack_master_node_coordinates():
    assert detect(Config(), DSTACK_NODE) == Cluster("dstack", f"10.2.0.9:{CLOUD_PORT}", 4, 3, run_id="dstack-wise-owl-1")
    with pytest.raises(ConfigError, match="DSTACK_NODE_RANK='x' is not an integer"):
        detect(Config(), {**DSTACK_NODE, "DSTACK_NODE_RANK": "x"})
    v6 = detect(Config(), {**DSTACK_NODE, "DSTACK_MASTER_NODE_IP": "fd00::9"})
    assert v6.coordinator_address == f"[fd00::9]:{CLOUD_PORT}"


def test_flags_and_jax_variables_win_over_every_platform():
    everything = {**K8S_POD, **SKYPILOT_NODE, **DSTACK_NODE}
    flags = Config(coordinator_address="h:1", num_processes=2, process_id=1)
    assert detect(flags, everything, fqdn=K8S_FQDN).source == "explicit"
    assert detect(Config(), everything, fqdn=K8S_FQDN).source == "kubernetes"
    assert detect(Config(), {**SKYPILOT_NODE, **DSTACK_NODE}).source == "skypilot"


# ---------------------------------------------------------------------------------------------
# The shipped examples: their commands parse, and each pod or node finds the same coordinator.
# ---------------------------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _train_args(command: list[str] | str) -> list[str]:
    words = shlex.split(command) if isinstance(command, str) else list(command)
    return words[words.index("jaxdp.train") + 1:]


@pytest.mark.parametrize("name", ["jobset-cpu.yaml", "jobset-gpu.yaml"])
def test_kubernetes_examples(name):
    spec = yaml.safe_load((EXAMPLES / "kubernetes" / name).read_text())
    job = spec["spec"]["replicatedJobs"][0]
    pods = job["template"]["spec"]["template"]["spec"]
    container = pods["containers"][0]
    parse_args(_train_args(container["command"]))
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    count = job["template"]["spec"]["completions"]
    assert env["JAX_NUM_PROCESSES"] == str(count)
    prefix = f"{spec['metadata']['name']}-{job['name']}-0"  # JobSet's pod names, its own name as subdomain
    found = {detect(Config(), {**env, "JOB_COMPLETION_INDEX": str(i)},
                    fqdn=f"{prefix}-{i}.{spec['metadata']['name']}.default.svc.cluster.local") for i in range(count)}
    assert {c.coordinator_address for c in found} == {f"{prefix}-0.jaxdp.default.svc.cluster.local:{CLOUD_PORT}"}
    assert sorted(c.process_id for c in found) == list(range(count))


def test_skypilot_and_dstack_examples():
    sky = yaml.safe_load((EXAMPLES / "skypilot.yaml").read_text())
    parse_args(_train_args(sky["run"].replace("\\\n", " ")))
    nodes = sky["num_nodes"]
    ips = "\n".join(f"10.0.0.{i + 1}" for i in range(nodes))
    assert {detect(Config(), {"SKYPILOT_NODE_IPS": ips, "SKYPILOT_NODE_RANK": str(r)}).coordinator_address
            for r in range(nodes)} == {f"10.0.0.1:{CLOUD_PORT}"}
    dstack = yaml.safe_load((EXAMPLES / "dstack.yml").read_text())
    parse_args(_train_args(dstack["commands"][-1]))
    assert detect(Config(), {"DSTACK_MASTER_NODE_IP": "10.0.0.1", "DSTACK_NODE_RANK": "1",
                             "DSTACK_NODES_NUM": str(dstack["nodes"])}).num_processes == dstack["nodes"]
