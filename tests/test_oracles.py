"""jaxdp against implementations it shares no code with: PyTorch DDP's bf16 and PowerSGD
communication hooks (run in 2 real torch.distributed gloo processes: tests/scripts/torch_hooks.py;
skipped without torch), and DiLoCo written out from the paper's Algorithm 1 in float64 numpy.

The torch processes start once for the module (5-9 s on 2 busy cores) and put fixed per-rank
gradients through the hooks themselves, as DDP would call them on a bucket; jaxdp puts the same
gradients through its codecs on 2 simulated devices, with psum and with the ring.
"""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P


import jaxdp
from helpers import ROOT, cli_env, free_port
from jaxdp.mesh import DATA_AXIS, make_mesh, shard_batch
from jaxdp.sync import codecs as C
from jaxdp.sync.collectives import ring_allreduce

pytestmark = pytest.mark.slow  # torch's two gloo ranks in subprocesses: 30 s in all on 2 cores

REDUCE = {"psum": lambda t: jax.lax.psum(t, DATA_AXIS), "ring": lambda t: ring_allreduce(t, DATA_AXIS)}
WORLD = 2  # ranks = devices: one rounding in every sum, whatever order psum, the ring and gloo add in

# One DDP bucket, in jaxdp's flatten order (sorted keys): two matrices PowerSGD compresses, a bias
# and a matrix too small to gain (both averaged uncompressed, by jaxdp and by the hook alike).
SHAPES = {"a": (24, 16), "b": (16,), "c": (40, 12), "d": (6, 5)}
SIZES = [math.prod(s) for s in SHAPES.values()]
SHAPES_LIKE = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
BF16_STEPS = 3
POWERSGD_RANKS = (2, 4)  # the hook orthogonalises by Gram-Schmidt at rank <= 2, by QR above
POWERSGD_START = 2       # the hook refuses error feedback before step 2 (DDP rebuilds its buckets at step 1)
POWERSGD_STEPS = 6       # 2 plain, then 4 compressed: error feedback and warm start carried through 3


def unflatten(flat):
    """A bucket (flat, in SHAPES order) -> the tree jaxdp sees."""
    pieces = np.split(flat, np.cumsum(SIZES)[:-1])
    return {k: p.reshape(s) for (k, s), p in zip(SHAPES.items(), pieces)}


def relative(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def torch_hooks(tmp_path_factory):
    """(inputs, outputs): the arrays given to both sides, and each rank's hook outputs by name."""
    pytest.importorskip("torch", reason="needs torch: the test extra (pip install -e '.[test]'); test-core leaves it out")
    directory = tmp_path_factory.mktemp("torch_hooks")
    rng = np.random.default_rng(0)
    scales = np.concatenate([np.full(size, scale) for size, scale in zip(SIZES, (1e-3, 1.0, 30.0, 1e-6))])
    inputs = {"bf16_grads": (rng.standard_normal((WORLD, BF16_STEPS, sum(SIZES))) * scales).astype(np.float32)}
    config = {"bf16": {"shapes": list(SHAPES.values())}, "powersgd": []}
    for rank in POWERSGD_RANKS:
        layout = C.PowerSGD(rank=rank).layout(SHAPES_LIKE)
        assert list(layout) == ["['a']", "['c']"]  # as the hook's _should_compress decides for these shapes
        inputs[f"rank{rank}_q0"] = np.concatenate([rng.standard_normal(m * r) for _, m, r in layout.values()])
        inputs[f"rank{rank}_grads"] = rng.standard_normal((WORLD, POWERSGD_STEPS, sum(SIZES))) * scales
        config["powersgd"].append({"name": f"rank{rank}", "rank": rank, "start": POWERSGD_START,
                                   "shapes": list(SHAPES.values()), "p_size": sum(n * r for n, _, r in layout.values())})
    np.savez(directory / "inputs.npz", **inputs)
    (directory / "config.json").write_text(json.dumps(config))

    env = cli_env(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")  # gloo's pairs on the loopback; 2 cores
    for attempt in range(3):  # torch's rendezvous can lose its port to another test on a busy machine
        address = f"127.0.0.1:{free_port()}"
        procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "scripts" / "torch_hooks.py"), str(rank),
                                   str(WORLD), address, str(directory)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for rank in range(WORLD)]
        try:
            outs = [p.communicate(timeout=90) for p in procs]
        finally:  # a hang or a failure leaves no process behind
            for p in procs:
                p.kill()
        if all(p.returncode == 0 for p in procs):
            break
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    return inputs, [dict(np.load(directory / f"out.{rank}.npz")) for rank in range(WORLD)]



def codec_runner(devices, comp, reduce):
    """(stacked grads, stacked state, step) -> stacked (mean, state): `comp.mean` on WORLD devices."""
    mesh = make_mesh(devices[:WORLD])

    def body(grads, state, step):
        mean, state, _ = comp.mean(jax.tree.map(lambda x: x[0], grads), jax.tree.map(lambda x: x[0], state),
                                   REDUCE[reduce], WORLD, step)
        return jax.tree.map(lambda x: x[None], (mean, state))

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(DATA_AXIS), P(DATA_AXIS), P()), out_specs=P(DATA_AXIS),
                               check_vma=False))
    return lambda grads, state, step: jax.device_get(fn(*shard_batch((grads, state), mesh), jnp.int32(step)))


def stacked(tree):
    return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (WORLD, *np.shape(x))).copy(), tree)


@pytest.mark.parametrize("reduce", ["psum", "ring"])
def test_bf16_is_bit_identical_to_ddp_bf16_compress_hook(devices, torch_hooks, reduce):
    """The hook casts to bfloat16, divides by the world size and all-reduces in bfloat16; jaxdp
    divides first (in float32), then casts. Dividing by 2 is exact either way, and a sum of two
    bfloat16 values is one rounding in any order: the means agree to the last bit."""
    inputs, outputs = torch_hooks
    run = codec_runner(devices, C.Bf16(), reduce)
    for step in range(BF16_STEPS):
        grads = inputs["bf16_grads"][:, step]
        mean, _ = run(jax.tree.map(lambda *rows: np.stack(rows), *map(unflatten, grads)), stacked(C.CompressionState()),
                      step)
        for device in range(WORLD):
            want = unflatten(outputs[device][f"bf16.{step}"])
            for k in SHAPES:
                np.testing.assert_array_equal(mean[k][device], want[k], err_msg=f"{k}, step {step}, rank {device}")
        assert not np.array_equal(want["c"], unflatten(grads.mean(0))["c"])  # bfloat16 did round


@pytest.mark.parametrize("reduce", ["psum", "ring"])
@pytest.mark.parametrize("rank", POWERSGD_RANKS)
def test_powersgd_equals_ddp_powersgd_hook_in_float64(devices, torch_hooks, rank, reduce):
    """Both start from the same Q (the hook's warm-start memory filled with it) and run 2 plain steps
    and 4 compressed ones on full-rank random gradients, where both orthonormalisations are well
    defined. The means, every rank's error feedback and the shared Q agree to rounding in float64.

    Sign convention: jaxdp's columns make R's diagonal positive, as the hook's Gram-Schmidt does
    (rank <= 2: Q itself agrees); at rank > 2 the hook takes LAPACK's QR as it comes, whose columns
    may have either sign, so Q agrees column by column up to sign there. P̂ P̂ᵀ, and so the mean and
    the errors, do not depend on the signs."""
    inputs, outputs = torch_hooks
    name = f"rank{rank}"
    comp = C.PowerSGD(rank=rank, start=POWERSGD_START)
    with jax.enable_x64(True):
        like = {k: jax.ShapeDtypeStruct(s, jnp.float64) for k, s in SHAPES.items()}
        layout = comp.layout(like)
        q0 = np.split(inputs[f"{name}_q0"], np.cumsum([m * r for _, m, r in layout.values()])[:-1])
        state = comp.init(like).replace(q={k: q.reshape(m, r) for (k, (_, m, r)), q in zip(layout.items(), q0)})
        state, run = stacked(state), codec_runner(devices, comp, reduce)
        for step in range(POWERSGD_STEPS):
            grads = inputs[f"{name}_grads"][:, step]
            mean, state = run(jax.tree.map(lambda *rows: np.stack(rows), *map(unflatten, grads)), state, step)
            for device in range(WORLD):
                want = unflatten(outputs[device][f"{name}.mean.{step}"])
                for k in SHAPES:
                    assert mean[k][device].dtype == np.float64
                    assert relative(mean[k][device], want[k]) <= 1e-10, (k, step, device)
            if step < POWERSGD_START:
                assert f"{name}.error.{step}" not in outputs[0]
                continue
            for device in range(WORLD):  # the hook keeps an error for the whole bucket; compare the compressed leaves
                error = unflatten(outputs[device][f"{name}.error.{step}"])
                for k in ("a", "c"):
                    assert relative(state.error[f"['{k}']"][device], error[k]) <= 1e-10, (k, step, device)
            torch_q = np.split(outputs[0][f"{name}.q.{step}"], np.cumsum([m * r for _, m, r in layout.values()])[:-1])
            for (k, (_, m, r)), want in zip(layout.items(), torch_q):
                got, want = state.q[k][0], want.reshape(m, r)
                if rank > 2:
                    want = want * np.sign(np.sum(want * got, axis=0))
                assert relative(got, want) <= 1e-10, (k, step)


# ---------------------------------------------------------------------------------------------
# DiLoCo (Douillard et al., 2023, Algorithm 1) in float64 numpy: every worker takes H inner steps
# (AdamW or SGD) on its own slice of each batch, keeping its inner optimizer state across rounds;
# then the outer optimizer (SGD with Nesterov momentum, heavy-ball momentum or none, in PyTorch's
# formulation) steps the global parameters along the averaged pseudo-gradient
# Δ = θ - mean_i(θ_i), and every worker restarts from them.
# ---------------------------------------------------------------------------------------------

INNER = {"adamw": {"lr": 0.03, "b1": 0.9, "b2": 0.99, "eps": 1e-8, "weight_decay": 0.1}, "sgd": {"lr": 0.1}}
OUTER = {"nesterov": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
         "heavy ball": {"lr": 0.7, "momentum": 0.9, "nesterov": False},
         "plain": {"lr": 0.8, "momentum": 0.0, "nesterov": False}}
H, ROUNDS, WORKERS = 3, 3, 4


def regression_loss(params, batch):
    residual = batch["x"] @ params["w"] + params["b"] - batch["y"]
    return 0.5 * jnp.mean(jnp.sum(residual ** 2, axis=-1))


def regression_grads(params, x, y):
    residual = x @ params["w"] + params["b"] - y
    return {"w": x.T @ residual / len(x), "b": residual.mean(axis=0)}


def inner_step(kind, params, state, grads):
    """One AdamW (decoupled weight decay, bias-corrected moments) or SGD step of one worker."""
    c = INNER[kind]
    if kind == "sgd":
        return {k: params[k] - c["lr"] * grads[k] for k in params}, state
    count = state["count"] + 1
    mu = {k: c["b1"] * state["mu"][k] + (1 - c["b1"]) * grads[k] for k in params}
    nu = {k: c["b2"] * state["nu"][k] + (1 - c["b2"]) * grads[k] ** 2 for k in params}
    new = {}
    for k in params:
        mu_hat, nu_hat = mu[k] / (1 - c["b1"] ** count), nu[k] / (1 - c["b2"] ** count)
        new[k] = params[k] - c["lr"] * (mu_hat / (np.sqrt(nu_hat) + c["eps"]) + c["weight_decay"] * params[k])
    return new, {"count": count, "mu": mu, "nu": nu}


def diloco(params, batches, inner, outer):
    """The global parameters and every worker's parameters after each step."""
    c = OUTER[outer]
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    global_, momentum = dict(params), dict(zeros)
    workers = [dict(params) for _ in range(WORKERS)]
    states = [{"count": 0, "mu": dict(zeros), "nu": dict(zeros)} for _ in range(WORKERS)]
    history = []
    for t, batch in enumerate(batches):
        for i, (x, y) in enumerate(zip(np.split(batch["x"], WORKERS), np.split(batch["y"], WORKERS))):
            workers[i], states[i] = inner_step(inner, workers[i], states[i], regression_grads(workers[i], x, y))
        if (t + 1) % H == 0:
            for k in global_:
                delta = global_[k] - np.mean([w[k] for w in workers], axis=0)
                momentum[k] = c["momentum"] * momentum[k] + delta
                step = delta + c["momentum"] * momentum[k] if c["nesterov"] else momentum[k]
                global_[k] = global_[k] - c["lr"] * step
            workers = [dict(global_) for _ in range(WORKERS)]
        history.append((dict(global_), [dict(w) for w in workers]))
    return history


@pytest.mark.parametrize("inner, outer, strategy", [("adamw", "nesterov", "psum"), ("adamw", "nesterov", "ring"),
                                                    ("sgd", "heavy ball", "psum"), ("sgd", "plain", "ring")])
def test_local_steps_equal_diloco_from_the_paper_in_float64(devices, inner, outer, strategy):
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((5, 3)), "b": rng.standard_normal(3)}
    teacher = rng.standard_normal((5, 3))
    batches = []
    for _ in range(H * ROUNDS):
        x = rng.standard_normal((8 * WORKERS, 5))
        batches.append({"x": x, "y": x @ teacher + 0.1 * rng.standard_normal((8 * WORKERS, 3))})
    want = diloco(params, batches, inner, outer)

    c = OUTER[outer]
    a = INNER["adamw"]
    tx = (optax.adamw(a["lr"], b1=a["b1"], b2=a["b2"], eps=a["eps"], weight_decay=a["weight_decay"])
          if inner == "adamw" else optax.sgd(INNER["sgd"]["lr"]))
    outer_tx = optax.sgd(c["lr"], momentum=c["momentum"] or None, nesterov=c["nesterov"])
    mesh = make_mesh(devices[:WORKERS])
    with jax.enable_x64(True):
        state = jaxdp.init_state(params, tx, mesh, sync_every=H, outer_tx=outer_tx)
        step = jaxdp.make_train_step(regression_loss, tx, mesh, strategy, sync_every=H, outer_tx=outer_tx)
        for t, batch in enumerate(batches):
            state, metrics = step(state, shard_batch(batch, mesh))
            assert float(metrics["synced"]) == float((t + 1) % H == 0)
            global_, workers = want[t]
            got = jax.device_get(state.params)
            replicas = jax.device_get(state.sync.per_device[jaxdp.step.local_sgd.STATE_NAME]["params"])
            for k in params:
                assert got[k].dtype == np.float64
                assert relative(got[k], global_[k]) <= 1e-12, (k, t)
                for i in range(WORKERS):
                    assert relative(replicas[k][i], workers[i][k]) <= 1e-12, (k, t, i)
    moved = relative(want[-1][0]["w"], params["w"])
    assert moved > 0.1, moved  # three rounds went somewhere
