"""Datasets and a deterministic, stateless batch order.

The rows of global batch `step` are a pure function of (seed, step): epochs are permutations
seeded by (seed, epoch) and laid end to end. So any process can compute its slice of any batch
without coordination, a resumed run sees exactly the batches an uninterrupted run would, and
the "iterator position" to checkpoint is just the step.

Each process loads only its contiguous slice of every global batch (`local_batch`); the mesh puts
process p's devices in a contiguous block, so 2 processes x 4 devices see exactly what 1 process
x 8 devices sees.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from typing import Iterator

import numpy as np

from jaxdp.data.digest import sample_digest
from jaxdp.data.order import eval_batches, local_batch
from jaxdp.errors import InputError


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A classification dataset in memory. Token streams (jaxdp/data/tokens.py) have the same methods."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    kind = "classification"

    def example(self) -> np.ndarray:
        """One input row, for initialising a model."""
        return self.x_train[:1]

    def train_batch(self, batch_size: int, step: int, seed: int, process_index: int = 0,
                    process_count: int = 1) -> dict[str, np.ndarray]:
        return local_batch(self.x_train, self.y_train, batch_size, step, seed, process_index, process_count)

    def eval_batches(self, batch_size: int, process_index: int = 0, process_count: int = 1,
                     max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        n = len(self.x_test) if not max_batches else min(len(self.x_test), max_batches * batch_size)
        return eval_batches(self.x_test[:n], self.y_test[:n], batch_size, process_index, process_count)

    def fingerprint(self) -> dict[str, str]:
        """What every process of a run must read alike (jaxdp/cluster/agreement.py): the splits' shapes and
        dtypes, and a digest of a few evenly spaced rows of each (cheap, whatever the size)."""
        arrays = (self.x_train, self.y_train, self.x_test, self.y_test)
        what = (f"{len(self.x_train)} training and {len(self.x_test)} held-out rows of "
                f"{self.x_train.dtype}{list(self.x_train.shape[1:])}, {self.num_classes} classes")
        return {"what": what, "digest": sample_digest(*arrays)}


def load_dataset(name: str, *, seq_len: int = 128, vocab_size: int | None = None,
                 tokenizer: str | None = None, text_column: str = "text") -> Dataset:
    """A built-in dataset of `jaxdp.registry.DATASETS` (digits, synthetic), a path to an .npz, a
    token stream (.txt, .bin, .npy: `jaxdp.data.tokens.TokenDataset`, cut into `seq_len` windows), or
    documents (a folder or glob of Parquet, Arrow, JSONL files: jaxdp/data/corpus.py, their `text_column`).

    `tokenizer`: a Hugging Face `tokenizers` JSON file that encodes a .txt or documents (else read as bytes)."""
    from jaxdp.config import is_corpus
    from jaxdp.registry import DATASETS

    if tokenizer is not None and not name.lower().endswith(".txt") and not is_corpus(name):
        raise InputError(f"a tokenizer encodes text: dataset {name!r} is not a .txt file", argument="tokenizer")
    if name in DATASETS:
        return DATASETS[name]()
    if is_corpus(name):
        from jaxdp.data.corpus import load_corpus

        return load_corpus(name, seq_len, vocab_size, tokenizer=tokenizer, text_column=text_column)
    if name.lower().endswith((".txt", ".bin", ".npy")):
        from jaxdp.data.tokens import load_tokens

        return load_tokens(name, seq_len, vocab_size, tokenizer=tokenizer)
    return load_npz(name)


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float) -> tuple[np.ndarray, ...]:
    """A fixed train/held-out split (independent of --seed, so accuracies are comparable)."""
    order = np.random.default_rng(0).permutation(len(x))
    n_test = max(1, int(round(len(x) * test_fraction)))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def digits() -> Dataset:
    """scikit-learn's 8x8 images of handwritten digits, 20 % held out."""
    table = _digits_table()  # (1797, 65): 64 pixels in 0..16, then the label
    x = (table[:, :64].reshape(-1, 8, 8) / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1) in [0, 1]
    y = table[:, 64].astype(np.int32)
    return Dataset(*_split(x, y, 0.2), num_classes=10)


def _digits_table() -> np.ndarray:
    """The file `sklearn.datasets.load_digits` reads (it ships with scikit-learn: no download), read
    directly: importing sklearn.datasets (it pulls in scipy.stats) costs every run's start-up more
    than reading the file does (docs/performance.md, "Behind the defaults")."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    path = None if spec is None or not spec.submodule_search_locations else \
        Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if path is None or not path.is_file():  # another layout: the public loader
        from sklearn.datasets import load_digits

        digits = load_digits()
        return np.concatenate([digits.data, digits.target[:, None]], axis=1)
    return np.loadtxt(path, delimiter=",")


def synthetic(n_train: int = 8192, n_test: int = 1024, shape: tuple[int, ...] = (28, 28, 1),
              num_classes: int = 10) -> Dataset:
    """Gaussian images labelled by a fixed random linear teacher: learnable, and any size."""
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((n_train + n_test, *shape), dtype=np.float32)
    teacher = rng.standard_normal((int(np.prod(shape)), num_classes), dtype=np.float32)
    y = np.argmax(x.reshape(len(x), -1) @ teacher, axis=1).astype(np.int32)
    return Dataset(x[:n_train], y[:n_train], x[n_train:], y[n_train:], num_classes)


def load_npz(path: str) -> Dataset:
    """User data: an .npz with `x` (N, ...) and integer labels `y` (N,); optional `x_test`, `y_test`."""
    if not os.path.isfile(path):
        raise InputError(f"dataset file {path!r} does not exist", argument="dataset")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise InputError(f"dataset file {path!r} is not a readable .npz archive ({err})", argument="dataset") from None
    for key in ("x", "y"):
        if key not in arrays:
            raise InputError(f"dataset file {path!r} has no array {key!r}; save it with np.savez(path, x=..., y=...)", argument="dataset")
    x, y = _check_xy(arrays["x"], arrays["y"], path, "x", "y")
    if "x_test" in arrays and "y_test" in arrays:
        x_test, y_test = _check_xy(arrays["x_test"], arrays["y_test"], path, "x_test", "y_test")
        if x_test.shape[1:] != x.shape[1:]:
            raise InputError(f"dataset file {path!r}: x_test rows have shape {x_test.shape[1:]}, x rows {x.shape[1:]}", argument="dataset")
        splits = (x, y, x_test, y_test)
    else:
        if len(x) < 2:
            raise InputError(f"dataset file {path!r} needs at least 2 examples to hold one out", argument="dataset")
        splits = _split(x, y, 0.1)
    num_classes = int(max(y.max(), splits[3].max())) + 1
    return Dataset(*splits, num_classes=num_classes)


def _check_xy(x: np.ndarray, y: np.ndarray, path: str, xname: str, yname: str) -> tuple[np.ndarray, np.ndarray]:
    where = f"dataset file {path!r}"
    if x.ndim < 2 or not np.issubdtype(x.dtype, np.number):
        raise InputError(f"{where}: {xname} must be a numeric array of shape (N, features...), got {x.dtype} {x.shape}", argument="dataset")
    if y.ndim != 1:
        raise InputError(f"{where}: {yname} must be a 1-D array of integer labels, got shape {y.shape}", argument="dataset")
    if len(x) != len(y):
        raise InputError(f"{where}: {xname} has {len(x)} rows but {yname} has {len(y)}; they must match", argument="dataset")
    if len(x) == 0:
        raise InputError(f"{where}: {xname} is empty", argument="dataset")
    if not np.issubdtype(y.dtype, np.integer) and not (np.issubdtype(y.dtype, np.floating) and np.all(np.mod(y, 1) == 0)):
        raise InputError(f"{where}: {yname} must hold integer class labels, got {y.dtype}", argument="dataset")
    if y.min() < 0:
        raise InputError(f"{where}: {yname} has negative labels; use 0 .. num_classes - 1", argument="dataset")
    x = x.astype(np.float32)
    if not np.all(np.isfinite(x)):
        raise InputError(f"{where}: {xname} contains NaN or infinite values", argument="dataset")
    if x.ndim == 3:  # (N, H, W) images: add a channel axis
        x = x[..., None]
    return x, y.astype(np.int32)
