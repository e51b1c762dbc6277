"""Token streams for language models: a text file, or nanoGPT-style token id files, memory-mapped.

    python -m jaxdp.train --model gpt --dataset my_book.txt                 # bytes: vocabulary 256
    python -m jaxdp.train --model gpt --dataset my_book.txt --tokenizer tokenizer.json  # its vocabulary
    python -m jaxdp.train --model gpt --dataset train.bin --vocab-size 50304  # uint16 ids (uint32 above 65536)
    python -m jaxdp.train --model gpt --dataset tokens.npy --vocab-size 50304 # any integer .npy

A text with a tokenizer (a Hugging Face `tokenizers` JSON file) is encoded once, in bounded memory,
into a cache file of ids that is memory-mapped like a .bin (jaxdp/data/tokenizer.py). The file is
memory-mapped, never read whole into memory: a step reads only the windows of its own
process's slice of the global batch. Loading checks every token id against the vocabulary once, in
chunks of `SCAN_CHUNK` ids (a bad id in the held-out tail used to surface only at the final
evaluation, after all the training), in the file's own dtype (an int64 id of 2**32 + 5 is not 5).
The stream is cut into non-overlapping windows of `seq_len + 1` tokens (inputs, and the same
shifted by one as targets). The last `HELD_OUT_FRACTION` of the tokens is the
held-out split, fixed whatever the seed; the windows before it are the training set, and global
batch `step` is the same pure function of (seed, step) as for every dataset (`jaxdp.data.order`), so
resume and multi-process runs see exactly the batches a single uninterrupted run sees.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Iterator

import numpy as np

from jaxdp.data.digest import sample_digest
from jaxdp.data.order import global_batch_indices
from jaxdp.errors import InputError

HELD_OUT_FRACTION = 0.1  # the tail of the stream: a fixed split, independent of --seed
SCAN_CHUNK = 1 << 24  # token ids per chunk of the load-time range check: at most 128 MB of int64 at a time


@dataclasses.dataclass(frozen=True)
class TokenDataset:
    """A memory-mapped stream of token ids cut into windows of `seq_len + 1` tokens."""

    path: str
    tokens: np.ndarray     # 1-D, memory-mapped: never copied whole
    vocab_size: int
    seq_len: int
    n_train_tokens: int    # tokens[:n_train_tokens] train; the rest is held out

    kind = "tokens"

    @property
    def train_windows(self) -> int:
        return (self.n_train_tokens - 1) // self.seq_len

    @property
    def held_out_windows(self) -> int:
        return (len(self.tokens) - self.n_train_tokens - 1) // self.seq_len

    def example(self) -> np.ndarray:
        """One input row, for initialising a model."""
        return np.zeros((1, self.seq_len), np.int32)

    def fingerprint(self) -> dict[str, str]:
        """What every process of a run must read alike (jaxdp/cluster/agreement.py): the size, and a digest
        of a few evenly spaced blocks of ids (cheap: it reads 512 KB, whatever the file's size)."""
        return {"what": f"{len(self.tokens)} {self.tokens.dtype} token ids", "digest": sample_digest(self.tokens)}

    def _windows(self, starts: np.ndarray) -> dict[str, np.ndarray]:
        rows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1]) for s in starts])
        # Hazard: range-check in the file's dtype, then cast (int64 2**32 + 5 cast to int32 is 5).
        # Loading checked the whole file already; this catches a file changed under a running job.
        if rows.size and (rows.max() >= self.vocab_size or rows.min() < 0):
            bad = int(rows.max() if rows.max() >= self.vocab_size else rows.min())
            raise InputError(f"dataset file {self.path!r} holds token id {bad}, outside the vocabulary of "
                             f"{self.vocab_size}; pass the tokenizer's vocabulary size", argument="vocab_size")
        rows = rows.astype(np.int32)
        return {"x": rows[:, :-1], "y": rows[:, 1:]}

    def train_batch(self, batch_size: int, step: int, seed: int, process_index: int = 0,
                    process_count: int = 1) -> dict[str, np.ndarray]:
        """This process's contiguous slice of global batch `step` (reads only those windows)."""
        per_process = batch_size // process_count
        windows = global_batch_indices(self.train_windows, batch_size, step, seed)
        mine = windows[process_index * per_process:(process_index + 1) * per_process]
        return self._windows(mine * self.seq_len)

    def eval_batches(self, batch_size: int, process_index: int = 0, process_count: int = 1,
                     max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """The held-out windows in global batches (the last zero-padded, `mask` 0 on padding rows)."""
        per_process = batch_size // process_count
        total = self.held_out_windows
        if max_batches:
            total = min(total, max_batches * batch_size)
        for start in range(0, total, batch_size):
            rows = np.arange(start, start + batch_size)[process_index * per_process:(process_index + 1) * per_process]
            real = rows < total
            batch = self._windows(self.n_train_tokens + np.where(real, rows, 0) * self.seq_len)
            yield {**batch, "mask": real.astype(np.float32)}


def load_tokens(path: str, seq_len: int, vocab_size: int | None = None, tokenizer: str | None = None) -> TokenDataset:
    """Memory-map `path` (.txt bytes, .bin uint16/uint32 ids, or an integer .npy) as a TokenDataset.

    `tokenizer`: a Hugging Face `tokenizers` JSON file, for a .txt only; the text's ids under it
    (encoded once into a cache, jaxdp/data/tokenizer.py), with its vocabulary size (or a larger
    `vocab_size`, e.g. padded to a multiple of 64)."""
    where = f"dataset file {path!r}"
    if not os.path.isfile(path):
        raise InputError(f"{where} does not exist", argument="dataset")
    suffix = os.path.splitext(path)[1].lower()
    if tokenizer is not None and suffix != ".txt":
        raise InputError(f"a tokenizer encodes text: {where} is not a .txt file (a .bin or .npy holds ids already)",
                         argument="tokenizer")
    try:
        if tokenizer is not None:
            from jaxdp.data import tokenizer as tokenizer_lib

            loaded, vocab_size = load_tokenizer(tokenizer, vocab_size)
            tokens = tokenizer_lib.cached_tokens(path, tokenizer, loaded)
        elif suffix == ".txt":
            tokens, vocab_size = np.memmap(path, dtype=np.uint8, mode="r"), bytes_vocabulary(vocab_size, where)
        elif suffix == ".bin":
            if vocab_size is None:
                raise InputError(f"{where} holds raw token ids: give its vocabulary size (uint16 ids up to "
                                 f"65536, uint32 above)", argument="vocab_size")
            dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
            if os.path.getsize(path) % np.dtype(dtype).itemsize:
                raise InputError(f"{where} is not a whole number of {np.dtype(dtype).name} token ids", argument="dataset")
            tokens = np.memmap(path, dtype=dtype, mode="r")
        elif suffix == ".npy":
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise InputError(f"{where} must hold a 1-D array of integer token ids, got {tokens.dtype} "
                                 f"{tokens.shape}", argument="dataset")
            if vocab_size is None:
                raise InputError(f"{where} holds token ids: give its vocabulary size", argument="vocab_size")
        else:
            raise InputError(f"{where} is not a token stream: use a .txt, .bin or .npy file", argument="dataset")
    except (OSError, ValueError) as err:
        if isinstance(err, InputError):
            raise
        raise InputError(f"{where} cannot be read as {suffix} tokens ({err})", argument="dataset") from None
    return token_dataset(path, tokens, int(vocab_size), seq_len)


def load_tokenizer(path: str, vocab_size: int | None) -> tuple[Any, int]:
    """The tokenizer in the JSON file `path` and the model's vocabulary: the tokenizer's, or a larger `vocab_size`."""
    from jaxdp.data import tokenizer as tokenizer_lib

    loaded = tokenizer_lib.load(path)
    own = loaded.get_vocab_size()
    if vocab_size is not None and vocab_size < own:
        raise InputError(f"the tokenizer {path!r} has {own} tokens, more than the vocabulary of {vocab_size}; leave "
                         f"the vocabulary size out (it is the tokenizer's), or give at least {own}", argument="vocab_size")
    return loaded, vocab_size or own


def bytes_vocabulary(vocab_size: int | None, where: str) -> int:
    """256: text without a tokenizer is read as bytes (InputError for another `vocab_size`)."""
    if vocab_size not in (None, 256):
        raise InputError(f"{where} is text, read as bytes: its vocabulary is 256, not {vocab_size}", argument="vocab_size")
    return 256


def token_dataset(path: str, tokens: np.ndarray, vocab_size: int, seq_len: int) -> TokenDataset:
    """`tokens` (read from `path`) as a TokenDataset, the last `HELD_OUT_FRACTION` held out; InputError if
    too short for a window in both splits or if an id is outside the vocabulary."""
    where = f"dataset file {path!r}"
    n_train = training_tokens(len(tokens))
    dataset = TokenDataset(path, tokens, int(vocab_size), seq_len, n_train)
    if dataset.train_windows < 1 or dataset.held_out_windows < 1:
        need = math.ceil((seq_len + 2) / HELD_OUT_FRACTION)
        raise InputError(f"{where} has {len(tokens)} tokens, too few for windows of {seq_len + 1} tokens in both "
                         f"the training split and the {HELD_OUT_FRACTION:.0%} held out; give at least {need} "
                         f"tokens or a shorter sequence length", argument="dataset")
    check_ids(tokens, int(vocab_size), where, n_train)
    return dataset


def training_tokens(n_tokens: int) -> int:
    """How many of a stream's `n_tokens` ids are the training split (the rest, the last
    `HELD_OUT_FRACTION`, is held out)."""
    return n_tokens - math.ceil(n_tokens * HELD_OUT_FRACTION)


def check_ids(tokens: np.ndarray, vocab_size: int, where: str, n_train: int | None = None) -> None:
    """InputError naming the first id outside 0 .. vocab_size - 1, and where it is.

    Reads the memory-mapped `tokens` once, `SCAN_CHUNK` ids at a time, comparing in their own dtype
    (no cast first). Free when the dtype cannot hold a bad id (bytes; uint16 ids with a vocabulary
    of 65536)."""
    info = np.iinfo(tokens.dtype)
    if info.min >= 0 and info.max < vocab_size:
        return
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = np.asarray(tokens[start:start + SCAN_CHUNK])
        if chunk.max() < vocab_size and (info.min >= 0 or chunk.min() >= 0):
            continue
        position = start + int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])
        split = "" if n_train is None else " (training split)" if position < n_train else " (held-out split)"
        raise InputError(f"{where} holds token id {int(tokens[position])} at position {position}{split}, outside "
                         f"the vocabulary of {vocab_size}; pass the tokenizer's vocabulary size", argument="vocab_size")


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the token frequencies: the loss of the best model that ignores context."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
