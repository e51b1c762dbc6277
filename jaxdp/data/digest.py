"""A cheap digest of large arrays: the processes of a run compare their datasets with it
(jaxdp/cluster/agreement.py) without reading a many-GB token file whole."""

from __future__ import annotations

import hashlib

import numpy as np


def sample_digest(*arrays: np.ndarray, samples: int = 16, block_bytes: int = 1 << 15) -> str:
    """A digest of each array's shape, dtype and `samples` evenly spaced blocks of about
    `block_bytes` (the first and the last among them): it tells apart data of other sizes or
    contents without reading it whole (a memory-mapped token file of many GB: 512 KB read)."""
    digest = hashlib.blake2b(digest_size=16)
    for array in arrays:
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        n = len(array)
        if not n:
            continue
        rows = max(1, block_bytes // max(1, array[:1].nbytes))
        for start in sorted({int(s) for s in np.linspace(0, max(n - rows, 0), samples)}):
            digest.update(np.ascontiguousarray(array[start:start + rows]).tobytes())
    return digest.hexdigest()
