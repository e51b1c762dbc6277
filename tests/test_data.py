"""Batch order (jaxdp/data/order.py) is a pure function of (seed, step), and process slices tile the global batch; datasets load."""

import numpy as np
import pytest

from jaxdp.data import datasets as data, order


def test_every_example_once_per_epoch_and_order_depends_on_seed():
    n, batch = 100, 10
    epoch = np.concatenate([order.global_batch_indices(n, batch, s, seed=3) for s in range(10)])
    assert sorted(epoch) == list(range(n))
    again = np.concatenate([order.global_batch_indices(n, batch, s, seed=3) for s in range(10)])
    other = np.concatenate([order.global_batch_indices(n, batch, s, seed=4) for s in range(10)])
    np.testing.assert_array_equal(epoch, again)
    assert not np.array_equal(epoch, other)


def test_batches_straddle_epoch_boundaries():
    n, batch = 10, 4  # step 2 holds rows 8, 9 of epoch 0 and rows 0, 1 of epoch 1
    stream = np.concatenate([order.global_batch_indices(n, batch, s, seed=0) for s in range(5)])
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_process_slices_concatenate_to_the_global_batch(processes):
    x, y = np.arange(50)[:, None].astype(np.float32), np.arange(50).astype(np.int32)
    for step in range(7):
        whole = order.local_batch(x, y, 16, step, seed=1)
        parts = [order.local_batch(x, y, 16, step, seed=1, process_index=p, process_count=processes)
                 for p in range(processes)]
        np.testing.assert_array_equal(np.concatenate([p["y"] for p in parts]), whole["y"])


def test_eval_batches_cover_the_set_once_with_a_mask():
    x, y = np.arange(23)[:, None].astype(np.float32), np.arange(23).astype(np.int32)
    batches = list(order.eval_batches(x, y, 8))
    seen = np.concatenate([b["y"][b["mask"] > 0] for b in batches])
    np.testing.assert_array_equal(seen, y)
    assert all(len(b["y"]) == 8 for b in batches)


def test_builtin_datasets():
    digits = data.load_dataset("digits")
    assert digits.x_train.shape[1:] == (8, 8, 1) and digits.num_classes == 10
    assert len(digits.x_train) + len(digits.x_test) == 1797
    synthetic = data.load_dataset("synthetic")
    assert synthetic.x_train.shape[1:] == (28, 28, 1) and set(np.unique(synthetic.y_train)) <= set(range(10))


def test_npz_with_and_without_a_test_split(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "d.npz"
    np.savez(path, x=rng.standard_normal((40, 5)), y=rng.integers(0, 3, 40))
    ds = data.load_dataset(str(path))
    assert len(ds.x_train) == 36 and len(ds.x_test) == 4 and ds.x_train.dtype == np.float32
    np.savez(path, x=rng.standard_normal((40, 4, 4)), y=rng.integers(0, 3, 40),
             x_test=rng.standard_normal((6, 4, 4)), y_test=rng.integers(0, 5, 6))
    ds = data.load_dataset(str(path))
    assert ds.x_train.shape == (40, 4, 4, 1) and len(ds.x_test) == 6 and ds.num_classes >= 3


def reference_indices(n, batch, step, seed):
    """The definition: position p of the endless stream is row perm(seed, p // n)[p % n]."""
    positions = step * batch + np.arange(batch)
    return np.array([np.random.default_rng([seed, p // n]).permutation(n)[p % n] for p in positions])


@pytest.mark.parametrize("n, batch, step", [(10, 4, 2), (7, 30, 3), (100, 100, 5), (3, 1000, 1)])
def test_indices_match_the_definition_for_any_batch_to_dataset_ratio(n, batch, step):
    np.testing.assert_array_equal(order.global_batch_indices(n, batch, step, seed=5), reference_indices(n, batch, step, 5))
    part = order.global_batch_indices(n, batch, step, seed=5, start=batch // 3, stop=batch // 2)
    np.testing.assert_array_equal(part, reference_indices(n, batch, step, 5)[batch // 3:batch // 2])


def test_a_batch_far_above_the_dataset_size_costs_its_own_size(monkeypatch):
    """A process's slice of a 4M-row batch of a 1,437-row dataset touches only the epochs it
    crosses (the whole global batch used to be computed by every process, with a pass over all
    its rows per epoch: quadratic in the batch size)."""
    calls = []
    original = order._epoch_permutation.__wrapped__
    monkeypatch.setattr(order, "_epoch_permutation", lambda n, seed, epoch: calls.append(epoch) or original(n, seed, epoch))
    x, y = np.zeros((1437, 1), np.float32), np.arange(1437, dtype=np.int32)
    batch = order.local_batch(x, y, 4_000_000, step=3, seed=0, process_index=7, process_count=400_000)
    assert len(batch["y"]) == 10 and len(set(calls)) <= 2
