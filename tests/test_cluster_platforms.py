"""Kubernetes (Indexed Job, JobSet), SkyPilot and dstack detection: pure functions of the environment.

Each platform's variables as its docs say it sets them (one process per node or pod); what detect() makes of
them, what wins when several sources are present, and the one-line errors for what cannot work. Then the
shipped examples (examples/): each rendered as its platform runs it, held to jaxdp's own start-up rules.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from jaxdp.checkpoint import dirlock
from jaxdp.checkpoint.dirlock import DirectoryLock
from jaxdp.cluster import detect as cluster
from jaxdp.cluster.detect import CLOUD_PORT, Cluster, detect
from jaxdp.config import Config, ConfigError, parse_args
from jaxdp.data.datasets import load_dataset
from jaxdp.registry import DATASETS

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
    assert detect(Config(), {**SKYPILOT_NODE, **DSTACK_AS_SKYPILOT}).source == "skypilot"  # (disagreeing: refused)


# ---------------------------------------------------------------------------------------------
# The shipped examples run as written: each is rendered as its platform would run it on every
# node (variables expanded, setup steps run in a sandbox, the train command recorded instead of
# run), then held to what jaxdp checks at start-up: (1) every process sees one checkpoint directory
# (jaxdp.checkpoint.dirlock itself, on the nodes' simulated disks: only a mount the file declares
# as shared is shared), (2) what the command reads is there on every node and loads alike,
# (3) detect() places every process, (4) the command parses and is the same on every node.
# ---------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# The platform's shell, with the train command recorded instead of run, and no installs.
SHIMS = r"""
pip() { :; }
python() {
  if [ "${1-}" = -m ] && [ "${2-}" = jaxdp.train ]; then shift 2; printf '%s\0' "$@" > "$JAXDP_TRAIN_ARGV"; return 0; fi
  "$JAXDP_PYTHON" "$@"
}
python3() { python "$@"; }
srun() { "$@"; }
scontrol() { :; }
"""


@dataclasses.dataclass
class Node:
    """One node (pod, task) of a rendered example: its environment, its own disk, and its mounts
    (container path -> directory; a shared mount is the same directory on every node)."""

    rank: int
    env: dict[str, str]
    root: Path
    mounts: dict[str, Path]
    cwd: str
    fqdn: str | None = None
    argv: list[str] | None = None

    def path(self, name: str) -> Path:
        """Where `name`, as this node's commands spell it, lies."""
        name = os.path.normpath(os.path.join(self.cwd, name))
        for mount in sorted(self.mounts, key=len, reverse=True):
            if name == mount or name.startswith(mount.rstrip("/") + "/"):
                return self.mounts[mount] / os.path.relpath(name, mount)
        return self.root / name.lstrip("/")

    def run(self, script: str, mounts: dict[str, Path] | None = None) -> None:
        """Run `script` with bash as the platform would on this node, its mount paths pointing into the sandbox;
        records the train command's arguments (`python -m jaxdp.train ...` is not run)."""
        for mount, where in sorted((mounts or self.mounts).items(), key=lambda m: -len(m[0])):
            if not where.exists():  # a volume is there from the pod's start
                where.mkdir(parents=True)
            script = re.sub(rf"(?<![\w./-]){re.escape(mount)}(?=/|[^\w.-]|$)", str(where), script)
        cwd = self.path(self.cwd)
        cwd.mkdir(parents=True, exist_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        record = self.root / "train-argv"
        env = {"PATH": os.environ["PATH"], "JAXDP_PYTHON": sys.executable, "JAXDP_TRAIN_ARGV": str(record),
               **self.env, "HOME": str(self.path(self.env.get("HOME", "/root")))}
        done = subprocess.run(["bash", "-c", SHIMS + script], cwd=cwd, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"node {self.rank}: the commands fail: {done.stderr.strip()}"
        if record.exists():  # the arguments as the node sees them: sandbox directories back to their paths
            back = sorted([(str(where), mount) for mount, where in (mounts or self.mounts).items()]
                          + [(str(self.root), "")], key=lambda m: -len(m[0]))
            self.argv = [next((mount + word[len(where):] for where, mount in back if word.startswith(where)), word)
                         for word in record.read_text().split("\0")[:-1]]


def _checkout(into: Path) -> None:
    """The repository's tracked files, as a workdir sync or a clone puts them on a node."""
    into.mkdir(parents=True, exist_ok=True)
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for top in sorted({line.split("/")[0] for line in tracked.splitlines()}):
        if (ROOT / top).exists():
            (into / top).symlink_to(ROOT / top)


def _expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), text)


def _skypilot(tmp: Path, spec: dict) -> list[Node]:
    envs = {k: str(v) for k, v in (spec.get("envs") or {}).items()}
    count, shared = spec.get("num_nodes", 1), {}
    for target, source in (spec.get("file_mounts") or {}).items():
        bucket = isinstance(source, dict) and (source.get("name") or "://" in str(source.get("source", "")))
        if bucket and source.get("mode", "MOUNT") == "MOUNT":  # every node mounts the one bucket
            shared[_expand(target, envs)] = tmp / "bucket" / _expand(str(source.get("name") or source["source"]),
                                                                      envs).replace("://", "/")
    ips = "\n".join(f"10.0.0.{i + 1}" for i in range(count))
    nodes = []
    for rank in range(count):
        env = {**envs, "HOME": "/home/sky", "SKYPILOT_NODE_IPS": ips, "SKYPILOT_NODE_RANK": str(rank),
               "SKYPILOT_NUM_NODES": str(count), "SKYPILOT_TASK_ID": "sky-2026-01-01-jaxdp"}
        node = Node(rank, env, tmp / f"node{rank}", shared, "/home/sky/sky_workdir")
        if spec.get("workdir") == ".":
            _checkout(node.path(node.cwd))
        node.run(f"{spec.get('setup') or ''}\n{spec['run']}")
        nodes.append(node)
    return nodes


def _dstack_volume_is_shared(name: str) -> bool:
    """A network volume that several nodes attach at once: the kubernetes backend's ReadWriteMany or
    RunPod's (AWS and GCP disks attach to one node at a time)."""
    for path in EXAMPLES.glob("*.yml"):
        spec = yaml.safe_load(path.read_text())
        if spec.get("type") == "volume" and spec.get("name") == name:
            return spec.get("backend") == "runpod" or "ReadWriteMany" in spec.get("access_modes", [])
    return False


def _dstack(tmp: Path, spec: dict) -> list[Node]:
    env = spec.get("env") or {}
    env = dict(item.split("=", 1) for item in env) if isinstance(env, list) else {k: str(v) for k, v in env.items()}
    count, shared = spec.get("nodes", 1), {}
    for volume in spec.get("volumes") or []:
        if isinstance(volume, dict) and "name" in volume and _dstack_volume_is_shared(volume["name"]):
            shared[volume["path"]] = tmp / "volume" / volume["name"]
    cwd = spec.get("working_dir", "/dstack/run")
    nodes = []
    for rank in range(count):
        node_env = {**env, "DSTACK_MASTER_NODE_IP": "10.0.0.1", "DSTACK_NODE_RANK": str(rank),
                    "DSTACK_NODES_NUM": str(count), "DSTACK_RUN_NAME": "wise-owl-1",
                    "DSTACK_NODES_IPS": "\n".join(f"10.0.0.{i + 1}" for i in range(count))}
        node = Node(rank, node_env, tmp / f"node{rank}", shared, cwd)
        if any(str((EXAMPLES / str(repo)).resolve()) == str(ROOT) for repo in spec.get("repos") or []):
            _checkout(node.path(cwd))  # repos: the repository, relative to the configuration file
        node.run("\n".join(spec["commands"]))
        nodes.append(node)
    return nodes


def _image(image: str, tmp: Path) -> tuple[dict[str, Path], str]:
    """The files docker/Dockerfile.<tag> copies into the image (path -> where), and its working directory."""
    dockerfile = ROOT / "docker" / f"Dockerfile.{image.rsplit(':', 1)[1]}"
    assert dockerfile.exists(), f"image {image}: no {dockerfile.relative_to(ROOT)} builds it"
    files, workdir = {}, "/"
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] == ["WORKDIR"]:
            workdir = os.path.join(workdir, words[1])
        elif words[:1] == ["COPY"]:
            *sources, target = words[1:]
            for source in sources:
                into = os.path.normpath(os.path.join(workdir, target, *([Path(source).name] if target.endswith("/") else [])))
                files[into] = ROOT / source
    return files, workdir


def _kubernetes(tmp: Path, docs: list[dict]) -> list[Node]:
    jobset = next(d for d in docs if d["kind"] == "JobSet")
    rwx = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"
           and "ReadWriteMany" in d["spec"]["accessModes"]}
    job = jobset["spec"]["replicatedJobs"][0]
    pod = job["template"]["spec"]["template"]["spec"]
    count = job["template"]["spec"]["completions"]
    prefix = f"{jobset['metadata']['name']}-{job['name']}-0"  # JobSet's pod names, its own name as subdomain
    nodes = []
    for index in range(count):
        root = tmp / f"pod{index}"
        volumes = {}
        for volume in pod.get("volumes", []):
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            volumes[volume["name"]] = tmp / "claims" / claim if claim in rwx else root / "volumes" / volume["name"]

        def mounts(container: dict) -> dict[str, Path]:
            files, _ = _image(container["image"], tmp)
            return {**files, **{m["mountPath"]: volumes[m["name"]] for m in container.get("volumeMounts", [])}}

        train = pod["containers"][0]
        env = {e["name"]: e["value"] for e in train.get("env", []) if "value" in e}
        env.update({e["name"]: "controller-uid-1" for e in train.get("env", []) if "fieldRef" in e.get("valueFrom", {})})
        env.update(JOB_COMPLETION_INDEX=str(index), HOSTNAME=f"{prefix}-{index}")
        node = Node(index, env, root, mounts(train), _image(train["image"], tmp)[1],
                    fqdn=f"{prefix}-{index}.{jobset['metadata']['name']}.default.svc.cluster.local")
        for init in pod.get("initContainers", []):
            assert init["command"][:2] in (["sh", "-c"], ["bash", "-c"]), init["command"]
            node.run(init["command"][2], mounts(init))
        words = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), w) for w in train["command"]]
        node.argv = words[words.index("jaxdp.train") + 1:]
        nodes.append(node)
    return nodes


def _slurm(tmp: Path, script: str) -> list[Node]:
    options = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, re.M))
    hosts = int(options.get("nodes", 1))
    count = int(options.get("ntasks", hosts * int(options.get("ntasks-per-node", 1))))
    per_host = -(-count // hosts)
    submit = tmp / "submit"  # the directory sbatch ran in: on the filesystem every node mounts
    nodes = []
    for task in range(count):
        env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": options.get("job-name", "job"), "SLURM_STEP_ID": "0",
               "SLURM_STEP_NODELIST": f"node[0-{hosts - 1}]" if hosts > 1 else "node0", "SLURM_NTASKS": str(count),
               "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task % per_host), "SLURM_NODEID": str(task // per_host),
               "SLURM_STEP_TASKS_PER_NODE": f"{per_host}(x{hosts})", "SLURM_SUBMIT_DIR": str(submit),
               "SLURM_CPUS_PER_TASK": options.get("cpus-per-task", "1")}
        node = Node(task, env, tmp / f"node{task // per_host}", {str(submit): submit}, str(submit))
        node.run(script)
        nodes.append(node)
    return nodes


class _Coordination:
    """JAX's key-value store as the processes of one run share it: what DirectoryLock asks of it."""

    def __init__(self):
        self.values, self.changed = {}, threading.Condition()

    def key_value_set(self, key, value):
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise TimeoutError(key)
            return self.values[key]


def _one_checkpoint_directory(directories: list[Path]) -> None:
    """jaxdp's start-up rule (jaxdp/checkpoint/dirlock.py), run for real: process 0 leaves a token in
    its directory, and every process must find it in its own."""
    client, errors = _Coordination(), {}

    def process(index: int) -> None:
        directories[index].mkdir(parents=True, exist_ok=True)
        try:
            DirectoryLock(str(directories[index]), index, len(directories), client, timeout_s=20).release()
        except Exception as err:  # noqa: BLE001 (reported below)
            errors[index] = err

    threads = [threading.Thread(target=process, args=(i,)) for i in range(len(directories))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, f"jaxdp stops at start-up: {errors[min(errors)]}"


EXAMPLE_FILES = ["skypilot.yaml", "dstack.yml", "kubernetes/jobset-cpu.yaml", "kubernetes/jobset-gpu.yaml",
                 "slurm/train.sbatch", "slurm/train_cpu.sbatch"]


def render(name: str, tmp: Path) -> list[Node]:
    text = (EXAMPLES / name).read_text()
    if name.endswith(".sbatch"):
        return _slurm(tmp, text)
    if name.startswith("kubernetes/"):
        return _kubernetes(tmp, [d for d in yaml.safe_load_all(text) if d])
    return (_skypilot if name.startswith("skypilot") else _dstack)(tmp, yaml.safe_load(text))


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_example_runs_as_written(name, tmp_path, monkeypatch):
    monkeypatch.setattr(dirlock, "_IDS", itertools.repeat(0))  # one coordination store per run
    nodes = render(name, tmp_path)
    assert len(nodes) > 1 and all(node.argv is not None for node in nodes), "a train command on every node"
    # (4) the command parses, and every process has the same flags (jaxdp compares them at start-up)
    configs = [parse_args(node.argv) for node in nodes]
    assert all(node.argv == nodes[0].argv for node in nodes)
    # (3) every process finds its place: one coordinator, one run, every index once
    found = [detect(config, node.env, fqdn=node.fqdn) for config, node in zip(configs, nodes)]
    assert [(c.process_id, c.num_processes) for c in found] == [(i, len(nodes)) for i in range(len(nodes))], found
    assert len({c.coordinator_address for c in found}) == 1 and len({c.run_id for c in found}) == 1 and found[0].run_id, found
    # (1) one checkpoint directory for every process
    assert configs[0].checkpoint_dir, "the command names a --checkpoint-dir"
    _one_checkpoint_directory([node.path(config.checkpoint_dir) for config, node in zip(configs, nodes)])
    # (2) what the command reads is there on every node, and reads alike (jaxdp compares the fingerprints)
    prints = []
    for config, node in zip(configs, nodes):
        for flag, value in (("--tokenizer", config.tokenizer), ("--init-from", config.init_from)):
            assert value is None or node.path(value).exists(), f"node {node.rank}: {flag} {value} does not exist"
        if config.dataset in DATASETS:
            continue
        where = node.path(config.dataset)
        assert where.exists(), f"node {node.rank}: --dataset {config.dataset} does not exist (nothing writes or mounts it)"
        data = load_dataset(str(where), seq_len=config.seq_len, vocab_size=config.vocab_size, tokenizer=config.tokenizer)
        assert data.train_batch(config.batch_size, 0, config.seed, node.rank, len(nodes))["x"].shape[0] > 0
        prints.append(data.fingerprint())
    assert all(p == prints[0] for p in prints)


def test_kubernetes_examples_name_their_image_and_claim():
    """The image is one the user builds and pushes (a registry placeholder), and the claim the pods
    share is defined beside them, ReadWriteMany."""
    for name in ("jobset-cpu.yaml", "jobset-gpu.yaml"):
        docs = [d for d in yaml.safe_load_all((EXAMPLES / "kubernetes" / name).read_text()) if d]
        pod = next(d for d in docs if d["kind"] == "JobSet")["spec"]["replicatedJobs"][0]["template"]["spec"]
        images = {c["image"] for c in pod["template"]["spec"]["containers"] + pod["template"]["spec"].get("initContainers", [])}
        assert images == {f"REGISTRY/jaxdp:{name[len('jobset-'):-len('.yaml')]}"}, images
        claims = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
        assert [c["spec"]["accessModes"] for c in claims] == [["ReadWriteMany"]], name


# ---------------------------------------------------------------------------------------------
# Both SkyPilot's and dstack's variables on one node; a bad JAX_COORDINATOR_PORT.
# ---------------------------------------------------------------------------------------------

DSTACK_AS_SKYPILOT = {"DSTACK_MASTER_NODE_IP": "10.1.0.5", "DSTACK_NODE_RANK": "1", "DSTACK_NODES_NUM": "3",
                      "DSTACK_RUN_NAME": "wise-owl-1"}  # SKYPILOT_NODE's node, as dstack would say it


@pytest.mark.parametrize("change, named", [
    ({"DSTACK_NODES_NUM": "4"}, "SKYPILOT_NODE_IPS lists 3 nodes, DSTACK_NODES_NUM=4"),
    ({"DSTACK_NODE_RANK": "2"}, "SKYPILOT_NODE_RANK=1, DSTACK_NODE_RANK=2"),
    ({"DSTACK_MASTER_NODE_IP": "10.2.0.9"}, "SKYPILOT_NODE_IPS starts with 10.1.0.5, DSTACK_MASTER_NODE_IP=10.2.0.9"),
    ({"SKYPILOT_NODE_IPS": "10.1.0.5"}, "SKYPILOT_NODE_IPS lists 1 nodes, DSTACK_NODES_NUM=3"),
])
def test_skypilot_and_dstack_variables_that_disagree_are_refused_naming_both(change, named):
    with pytest.raises(ConfigError) as err:
        detect(Config(), {**SKYPILOT_NODE, **DSTACK_AS_SKYPILOT, **change})
    line = str(err.value)
    assert line.startswith(f"SkyPilot's and dstack's variables disagree ({named}") and "\n" not in line, line
    assert line.endswith("or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID"), line


def test_skypilot_and_dstack_variables_that_agree_run_and_flags_win_over_both():
    assert detect(Config(), {**SKYPILOT_NODE, **DSTACK_AS_SKYPILOT}) == detect(Config(), SKYPILOT_NODE)
    # with JAX_COORDINATOR_ADDRESS the head is its host: only the count and the rank must agree
    env = {**SKYPILOT_NODE, **DSTACK_AS_SKYPILOT, "DSTACK_MASTER_NODE_IP": "10.2.0.9", "JAX_COORDINATOR_ADDRESS": "h:7"}
    assert detect(Config(), env).coordinator_address == "h:7"
    flags = Config(coordinator_address="h:1", num_processes=2, process_id=1)
    assert detect(flags, {**SKYPILOT_NODE, **DSTACK_NODE}).source == "explicit"


SLURM_TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
              "SLURM_LOCALID": "0"}


@pytest.mark.parametrize("port", ["99999", "0", "http", "12345x"])
@pytest.mark.parametrize("platform", ["slurm", "kubernetes", "skypilot", "dstack"])
def test_a_bad_coordinator_port_is_reported_as_jax_coordinator_port(platform, port):
    env = {"slurm": SLURM_TASK, "kubernetes": K8S_POD, "skypilot": SKYPILOT_NODE, "dstack": DSTACK_NODE}[platform]
    with pytest.raises(ConfigError) as err:
        detect(Config(), {**env, "JAX_COORDINATOR_PORT": port}, fqdn=K8S_FQDN)
    assert str(err.value) == f"JAX_COORDINATOR_PORT={port!r} is not a port between 1 and 65535"
    assert detect(Config(), {**env, "JAX_COORDINATOR_PORT": "7000"}, fqdn=K8S_FQDN).coordinator_address.endswith(":7000")
