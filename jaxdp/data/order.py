"""Batch order: which rows make global batch `step`, as a pure function of (seed, step), and each
process's slice of it.

    rows = global_batch_indices(n, batch_size, step, seed)             # the whole global batch
    mine = local_batch(x, y, batch_size, step, seed, process, count)   # this process's contiguous slice

A resumed run needs nothing but the step to continue the same sequence; every process computes
the same global order and takes its own slice, so no process ever exchanges indices.
"""

from __future__ import annotations

import functools
from typing import Iterator

import numpy as np


@functools.lru_cache(maxsize=4)
def _epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def global_batch_indices(n: int, batch_size: int, step: int, seed: int,
                         start: int = 0, stop: int | None = None) -> np.ndarray:
    """Row indices of global batch `step` (0-based) in an endless sequence of shuffled epochs.

    `start`, `stop`: only rows start..stop-1 of that batch (a process's slice). The positions of a
    batch are consecutive, so each epoch they cross contributes one contiguous slice of its
    permutation: O(stop - start) work plus one permutation per epoch crossed, whatever the ratio of
    batch size to dataset size (a batch of 4M rows of a 1,437-row dataset: one pass, not 2,900).
    """
    stop = batch_size if stop is None else stop
    first, last = step * batch_size + start, step * batch_size + stop  # positions first..last-1
    out = np.empty(last - first, dtype=np.int64)
    position = first
    while position < last:
        epoch, offset = divmod(position, n)
        take = min(n - offset, last - position)
        out[position - first:position - first + take] = _epoch_permutation(n, seed, epoch)[offset:offset + take]
        position += take
    return out


def local_batch(x: np.ndarray, y: np.ndarray, batch_size: int, step: int, seed: int,
                process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
    """This process's contiguous slice of global batch `step`."""
    per_process = batch_size // process_count
    rows = global_batch_indices(len(x), batch_size, step, seed, process_index * per_process,
                                (process_index + 1) * per_process)
    return {"x": x[rows], "y": y[rows]}


def eval_batches(x: np.ndarray, y: np.ndarray, batch_size: int, process_index: int = 0,
                 process_count: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """The whole held-out set in global batches of `batch_size`, this process's slice of each.

    The last batch is zero-padded; `mask` is 1 for real rows, so metrics weight by it.
    """
    per_process = batch_size // process_count
    for start in range(0, len(x), batch_size):
        rows = np.arange(start, start + batch_size)[process_index * per_process:(process_index + 1) * per_process]
        real = rows < len(x)
        rows = np.where(real, rows, 0)
        yield {"x": x[rows], "y": y[rows], "mask": real.astype(np.float32)}
