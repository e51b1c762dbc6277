"""`jaxdp.fit` on a grain pipeline (jaxdp/data/grain.py): a MapDataset is random access, an iterator's state
is saved with each checkpoint; both resume bit-identically, reading only the batches from the resumed step on."""

from __future__ import annotations

import json
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp.mesh import make_mesh

grain = pytest.importorskip("grain")

STEPS, BATCH = 6, 8
MODEL = nn.Dense(3)
PARAMS = MODEL.init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))["params"]
TX = optax.adam(1e-2)


def loss_fn(params, batch):
    logits = MODEL.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def record(i):
    rng = np.random.default_rng(int(i))
    return {"x": rng.standard_normal(4).astype(np.float32), "y": np.int32(i % 3)}


def pipeline(read: list):
    """Shuffled records in batches of BATCH; `read` collects the records it reads."""
    def load(i):
        read.append(int(i))
        return record(i)
    return grain.MapDataset.range(200).shuffle(seed=7).map(load).batch(BATCH)


def fit(data, tmp_path, **kwargs):
    return jaxdp.fit(loss_fn, PARAMS, TX, data, steps=STEPS, mesh=make_mesh(jax.devices()[:4]),
                     checkpoint_dir=str(tmp_path), save_every=2, progress=False, log_every=1, **kwargs)  # prefetch 2: reads ahead


def reference():
    """The same batches, on one device, with optax alone."""
    params, opt_state = PARAMS, TX.init(PARAMS)
    for batch in pipeline([])[:STEPS]:
        grads = jax.jit(jax.grad(loss_fn))(params, batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def same(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def resumed_run(make_data, tmp_path):
    """(the uninterrupted run, the run resumed from step 4, the records the resumed run read)."""
    whole = fit(make_data([]), tmp_path)
    shutil.rmtree(tmp_path / str(STEPS))  # back to step 4
    read = []
    return whole, fit(make_data(read), tmp_path), read


def test_a_map_dataset_is_batch_step_and_resumes_exactly(tmp_path):
    whole, resumed, read = resumed_run(pipeline, tmp_path)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 whole.state.params, reference())
    same(resumed.state, whole.state)
    assert [r["step"] for r in resumed.history] == [5, 6]
    assert len(read) == 2 * BATCH  # random access: only batches 4 and 5 were read


@pytest.mark.parametrize("kind", ["iter_dataset", "data_loader"])
def test_an_iterator_keeps_its_state_in_the_checkpoint_and_resumes_exactly(tmp_path, kind):
    def make(read):
        if kind == "iter_dataset":
            return iter(pipeline(read).to_iter_dataset())
        source = _Source(read)
        return grain.DataLoader(data_source=source, sampler=grain.samplers.IndexSampler(
            len(source), shuffle=True, seed=7, num_epochs=1), operations=[grain.transforms.Batch(BATCH)], worker_count=0)

    whole, resumed, read = resumed_run(make, tmp_path)
    same(resumed.state, whole.state)
    assert [r["step"] for r in resumed.history] == [5, 6]
    if kind == "iter_dataset":
        first = [int(i) for i in grain.MapDataset.range(200).shuffle(seed=7)[:4 * BATCH]]
    else:
        sampler = grain.samplers.IndexSampler(200, shuffle=True, seed=7, num_epochs=1)
        first = [sampler[k].record_key for k in range(4 * BATCH)]
    assert read and not set(read) & set(first)  # set to its saved state: batches 0-3 were not read again
    meta = json.loads((tmp_path / "4" / "meta" / "metadata").read_text())
    assert meta["data_iterator"]


class _Source:
    """A grain data source of `record`s that notes what it reads."""

    def __init__(self, read: list):
        self.read = read

    def __len__(self):
        return 200

    def __repr__(self):  # grain checks a restored state against the source's repr
        return "_Source(200)"

    def __getitem__(self, i):
        self.read.append(int(i))
        return record(i)
