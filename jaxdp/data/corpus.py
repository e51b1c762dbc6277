"""Documents as one token stream: a folder or glob of Parquet, Arrow (IPC / feather) and JSON-lines files,
or a Hugging Face dataset saved with `datasets.save_to_disk`.

    python -m jaxdp.train --model gpt --dataset shards/ --text-column text
    python -m jaxdp.train --model gpt --dataset 'shards/*.parquet' --tokenizer tokenizer.json
    python -m jaxdp.train --model gpt --dataset my_hf_dataset/          # save_to_disk's folder

The text column of every row is tokenized once, into the token cache of `--tokenizer`
(jaxdp/data/tokenizer.py: its directory, its lock), and memory-mapped from there like a .bin: a later
run with the same files reads no document. The cache file is keyed by the files (absolute paths,
sizes, modification times), the text column and the tokenizer (its file's contents; bytes without one).
Reading streams: a record batch of `BATCH_ROWS` rows (Parquet, Arrow) or a line (JSONL) at a time,
their ids appended to the file as they come, so memory stays flat for corpora larger than memory.

Files are read in the order of their paths (a folder: every such file under it, hidden ones left
out), a saved Hugging Face dataset in the order of its state.json (a DatasetDict: its "train" split).
Each file is read once, however many paths lead to it (by its real path: a recursive glob through a
link to a folder above, `DIR/**/*.jsonl` with `DIR/self -> .`, finds every file 40 times; one line
says so); a symbolic link that loops or leads to no file is an error naming it.
Every document is followed by a separator: the tokenizer's end-of-text token when it has one
(`EOT_TOKENS`), else the tokenizer's ids of "\\n"; without a tokenizer the text is UTF-8 bytes
(vocabulary 256) and the separator a newline byte, so a folder of documents gives exactly the
stream of a .txt file holding each document followed by a newline. Rows whose text is null are
left out, in one line with their count and files. Tokenizing also counts the held-out documents (the
stream's tail, jaxdp/data/tokens.py) whose text is a training document's too (by a 64-bit digest of
each document, spilled to a file beside the cache as it is written) and says how many, in one line:
those are no held-out text. Both lines come with the tokenizing, not on later runs that read the cache.
The result is a `TokenDataset`, so batch `step` is the same pure function of (seed, step)
as for every dataset and resume stays exact.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import hashlib
import json
import os
import re
import sys
from typing import Any, Callable, Iterator

import numpy as np

from jaxdp.config import CORPUS_SUFFIXES
from jaxdp.data import tokenizer as tokenizer_lib
from jaxdp.data.tokens import TokenDataset, bytes_vocabulary, load_tokenizer, token_dataset, training_tokens
from jaxdp.errors import InputError

BATCH_ROWS = 1024  # rows per record batch read (Parquet, Arrow); a JSONL batch is as many lines
EOT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
INSTALL_HINT = "pip install 'jaxdp-trainer[data]'"
QUIET_BYTES = 256 << 20  # corpora up to this size tokenize without progress lines
FORMAT_VERSION = 1  # in the cache key: a change to how documents become ids makes new cache files


def load_corpus(spec: str, seq_len: int, vocab_size: int | None = None, tokenizer: str | None = None,
                text_column: str = "text") -> TokenDataset:
    """The documents `spec` names (see the module docstring) as a memory-mapped TokenDataset."""
    files = find_files(spec)
    if tokenizer is not None:
        loaded, vocab_size = load_tokenizer(tokenizer, vocab_size)
        with open(tokenizer, "rb") as f:
            which = hashlib.sha256(f.read()).hexdigest()
        dtype = tokenizer_lib.id_dtype(loaded.get_vocab_size())
    else:
        loaded, vocab_size, which, dtype = None, bytes_vocabulary(vocab_size, f"--dataset {spec!r}"), "bytes", np.dtype(np.uint8)
    path = cache_path(spec, files, text_column, which)

    def build(path: str) -> None:
        print(f"jaxdp: tokenizing {len(files)} file(s) of {spec} (column {text_column!r}, once; cached as {path})",
              file=sys.stderr, flush=True)
        written = write_ids(files, text_column, loaded, path, dtype)
        for line in written.notes(spec, text_column):
            print(f"jaxdp: --dataset {spec}: {line}", file=sys.stderr, flush=True)

    tokenizer_lib.build_once(path, build, argument="dataset")
    tokens = np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)
    return token_dataset(spec, tokens, int(vocab_size), seq_len)


def find_files(spec: str) -> list[str]:
    """The data files of `spec` (a folder, a saved Hugging Face dataset, a glob or a file), in reading order."""
    if os.path.isdir(spec):
        if os.path.isfile(os.path.join(spec, "dataset_dict.json")):  # a DatasetDict: its splits are folders
            with open(os.path.join(spec, "dataset_dict.json")) as f:
                splits = json.load(f).get("splits", [])
            if "train" not in splits:
                raise InputError(f"--dataset {spec!r} is a Hugging Face DatasetDict without a 'train' split (it has "
                                 f"{', '.join(splits)}); give the split's folder", argument="dataset")
            print(f"jaxdp: --dataset {spec} is a Hugging Face DatasetDict: training on its 'train' split", file=sys.stderr)
            spec = os.path.join(spec, "train")
        if os.path.isfile(os.path.join(spec, "state.json")):  # datasets.save_to_disk: Arrow streams, in this order
            with open(os.path.join(spec, "state.json")) as f:
                return [os.path.join(spec, d["filename"]) for d in json.load(f)["_data_files"]]
        found = sorted(os.path.join(root, name) for root, dirs, names in os.walk(spec) for name in names
                       if not name.startswith(".") and name.lower().endswith(CORPUS_SUFFIXES)
                       and not any(part.startswith(".") for part in os.path.relpath(root, spec).split(os.sep) if part != "."))
        what = f"folder {spec!r} holds no {', '.join(CORPUS_SUFFIXES)} file"
    else:
        matches = sorted(glob.glob(spec, recursive=True))
        _check_links(p for p in matches if p.lower().endswith(CORPUS_SUFFIXES))
        found = [p for p in matches if os.path.isfile(p)]
        what = f"{spec!r} matches no file" if any(c in spec for c in "*?[") else f"dataset file {spec!r} does not exist"
        other = [p for p in found if not p.lower().endswith(CORPUS_SUFFIXES)]
        if other:
            raise InputError(f"--dataset {spec!r} matches {other[0]!r}, which is not one of {', '.join(CORPUS_SUFFIXES)}; "
                             f"narrow the pattern", argument="dataset")
    if not found:
        raise InputError(what, argument="dataset")
    _check_links(found)
    return _each_once(spec, found)


def _check_links(paths: Any) -> None:
    """InputError for the first of `paths` that is a symbolic link leading nowhere: to itself (a loop), or
    to a file that does not exist."""
    for path in paths:
        try:
            os.stat(path)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise InputError(f"dataset file {path!r} is a symbolic link that leads back to itself (a loop); "
                                 f"point it at a data file or remove it", argument="dataset") from None
            if os.path.islink(path) and err.errno == errno.ENOENT:
                raise InputError(f"dataset file {path!r} is a symbolic link to {os.readlink(path)!r}, which does "
                                 f"not exist; point it at a data file or remove it", argument="dataset") from None
            raise InputError(f"dataset file {path!r} cannot be read ({err.strerror or err})",
                             argument="dataset") from None


def _each_once(spec: str, files: list[str]) -> list[str]:
    """`files` less those that are the same file as an earlier one (by real path: a symbolic link to a
    file already there, or a link to a folder above it that a recursive glob followed), said in one line."""
    seen: set[str] = set()
    once = [p for p in files if not (os.path.realpath(p) in seen or seen.add(os.path.realpath(p)))]
    if len(once) < len(files):
        print(f"jaxdp: --dataset {spec} names {len(files)} paths but only {len(once)} different files (symbolic "
              f"links lead to the same files); reading each file once", file=sys.stderr, flush=True)
    return once


def cache_path(spec: str, files: list[str], text_column: str, tokenizer_digest: str) -> str:
    """The cache file of these files' `text_column` under a tokenizer (see the module docstring):
    `<name>-<which>-<version>.bin`, `which` the dataset, column and tokenizer, `version` the files as they are now."""
    which = hashlib.sha256(f"{os.path.abspath(spec)}\0{text_column}\0{tokenizer_digest}\0{FORMAT_VERSION}".encode())
    identity = [(os.path.realpath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in files]
    version = hashlib.sha256(json.dumps(identity).encode())
    name = re.sub(r"[^\w.-]", "_", os.path.basename(os.path.normpath(spec.split("*")[0])) or "documents")[:40]
    return os.path.join(tokenizer_lib.cache_dir(), f"{name}-{which.hexdigest()[:12]}-{version.hexdigest()[:12]}.bin")


@dataclasses.dataclass
class Written:
    """What `write_ids` wrote: the ids, the rows left out for a null text (by file), and the held-out
    documents (those whose ids start in the held-out tail, jaxdp/data/tokens.py) with a copy in training."""

    ids: int
    nulls: dict[str, int]
    held_out_documents: int
    held_out_copies: int

    def notes(self, spec: str, column: str) -> list[str]:
        """What the user should hear of: a line for the null texts, one for copies across the split."""
        lines = []
        if self.nulls:
            where = ", ".join(f"{n} in {path}" for path, n in list(self.nulls.items())[:3])
            more = f" and {len(self.nulls) - 3} more file(s)" if len(self.nulls) > 3 else ""
            lines.append(f"left out {sum(self.nulls.values())} row(s) whose {column!r} is null ({where}{more})")
        if self.held_out_copies:
            lines.append(f"{self.held_out_copies} of the {self.held_out_documents} held-out documents are copies of "
                         f"training documents (the same text), so the held-out loss overrates the model; remove the "
                         f"duplicate documents for a clean held-out split")
        return lines


def write_ids(files: list[str], text_column: str, tokenizer: Any, out_path: str, dtype: np.dtype) -> Written:
    """Every document of `files` and its separator, as ids of `dtype`, into `out_path` (through a temporary
    file and a rename); returns what it wrote (`Written`). Progress: a line per tenth of the bytes read."""
    encode = _bytes_encoder() if tokenizer is None else _tokenizer_encoder(tokenizer)
    progress = _Progress(sum(os.path.getsize(p) for p in files))
    tmp, count, nulls = f"{out_path}.tmp-{os.getpid()}", 0, {}
    copies = _Copies(f"{tmp}.documents")
    try:
        with open(tmp, "wb") as out, copies:
            for path in files:
                for documents, read in read_documents(path, text_column):
                    if None in documents:
                        nulls[path] = nulls.get(path, 0) + documents.count(None)
                        documents = [d for d in documents if d is not None]
                    ids, lengths = encode(documents)
                    copies.add(documents, count, lengths)
                    np.asarray(ids, dtype).tofile(out)
                    count += len(ids)
                    progress(read)
        held_out, copied = copies.across_the_split(training_tokens(count))
        os.replace(tmp, out_path)
    finally:
        for path in (tmp, copies.path):
            if os.path.exists(path):
                os.remove(path)
    return Written(count, nulls, held_out, copied)


class _Copies:
    """Each document's digest and where its ids start, spilled to the file `path` as they come (memory stays
    flat), to count the held-out documents whose text is also in the training split. Blank documents are
    left out: an empty line repeated is no leak."""

    RECORD = np.dtype([("digest", "<u8"), ("start", "<i8")])
    CHUNK = 1 << 22  # training records compared at a time

    def __init__(self, path: str):
        self.path, self.file = path, None

    def __enter__(self) -> "_Copies":
        self.file = open(self.path, "wb")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.file.close()

    def add(self, documents: list[str], start: int, lengths: np.ndarray) -> None:
        records = np.empty(len(documents), self.RECORD)
        records["digest"] = [int.from_bytes(hashlib.blake2b(d.encode("utf-8", "replace"), digest_size=8).digest(),
                                            "little") for d in documents]
        records["start"] = start + np.cumsum(lengths) - lengths
        records[[bool(d.strip()) for d in documents]].tofile(self.file)

    def across_the_split(self, n_train: int) -> tuple[int, int]:
        """(held-out documents, how many of them have a copy among the training documents), the held-out
        documents being those whose ids start at or after `n_train`."""
        if not os.path.getsize(self.path):
            return 0, 0
        records = np.memmap(self.path, self.RECORD, mode="r")
        first = int(np.searchsorted(records["start"], n_train))  # starts grow: the held-out ones are the tail
        held, inverse = np.unique(np.asarray(records["digest"][first:]), return_inverse=True)
        seen = np.zeros(len(held), bool)
        for begin in range(0, first, self.CHUNK):
            digests = np.asarray(records["digest"][begin:min(first, begin + self.CHUNK)])
            at = np.minimum(np.searchsorted(held, digests), max(len(held) - 1, 0))
            if len(held):
                seen[at[held[at] == digests]] = True
        del records
        return len(inverse), int(seen[inverse].sum())


def _bytes_encoder() -> Callable[[list[str]], tuple[np.ndarray, np.ndarray]]:
    def encode(documents: list[str]) -> tuple[np.ndarray, np.ndarray]:
        parts = [d.encode("utf-8", "replace") + b"\n" for d in documents]
        return np.frombuffer(b"".join(parts), np.uint8), np.asarray([len(p) for p in parts], np.int64)
    return encode


def _tokenizer_encoder(tokenizer: Any) -> Callable[[list[str]], tuple[np.ndarray, np.ndarray]]:
    """Each document's ids, then the separator (and each document's number of ids, separator included); a
    long document is encoded in pieces cut where the pre-tokenizer splits anyway (jaxdp/data/tokenizer.py),
    so its ids are those of the whole."""
    eot = next((tokenizer.token_to_id(t) for t in EOT_TOKENS if tokenizer.token_to_id(t) is not None), None)
    separator = np.asarray([eot] if eot is not None else tokenizer.encode("\n", add_special_tokens=False).ids, np.int64)

    def encode(documents: list[str]) -> tuple[np.ndarray, np.ndarray]:
        pieces = [tokenizer_lib._pieces(d, tokenizer_lib.PIECE_CHARS) for d in documents]
        encodings = iter(tokenizer.encode_batch([p for ps in pieces for p in ps], add_special_tokens=False))
        out, lengths = [], []
        for ps in pieces:
            ids = [np.asarray(next(encodings).ids, np.int64) for _ in ps] + [separator]
            out += ids
            lengths.append(sum(len(i) for i in ids))
        return (np.concatenate(out) if out else np.zeros(0, np.int64)), np.asarray(lengths, np.int64)
    return encode


def read_documents(path: str, column: str) -> Iterator[tuple[list[str | None], int]]:
    """(documents, bytes of the file read for them) a batch at a time; a null text is None (`write_ids`
    counts and leaves them out)."""
    if path.lower().endswith((".jsonl", ".ndjson")):
        yield from _jsonl(path, column)
        return
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"reading {os.path.basename(path)} needs pyarrow: {INSTALL_HINT}", argument="dataset") from None
    size = os.path.getsize(path)
    try:
        if path.lower().endswith(".parquet"):
            source = pq.ParquetFile(path)
            _check_column(source.schema_arrow, column, path)
            total = max(1, source.metadata.num_rows)
            for batch in source.iter_batches(batch_size=BATCH_ROWS, columns=[column]):
                yield _texts(batch.column(0)), size * batch.num_rows // total
            return
        with pa.memory_map(path) as source:  # Arrow IPC: the file format (feather v2) or a stream (save_to_disk)
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                batches = iter(reader)
            _check_column(reader.schema, column, path)
            position = 0
            for i, batch in enumerate(batches):
                # bytes read: the stream's position, or the file's share per batch (random access)
                now = source.tell() if not hasattr(reader, "num_record_batches") else size * (i + 1) // reader.num_record_batches
                for start in range(0, batch.num_rows, BATCH_ROWS):  # a huge batch: a slice at a time (zero-copy)
                    last = start + BATCH_ROWS >= batch.num_rows
                    yield _texts(batch.slice(start, BATCH_ROWS).column(column)), (now - position) if last else 0
                position = now
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"dataset file {path!r} cannot be read as {os.path.splitext(path)[1]} ({err})",
                         argument="dataset") from None


def _check_column(schema: Any, column: str, path: str) -> None:
    import pyarrow as pa

    if column not in schema.names:
        raise InputError(f"dataset file {path!r} has no column {column!r} (it has {', '.join(schema.names)}); "
                         f"name the text column with --text-column", argument="dataset")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or getattr(pa.types, "is_string_view", bool)(kind)):
        raise InputError(f"dataset file {path!r}: column {column!r} holds {kind}, not text; name the text column "
                         f"with --text-column", argument="dataset")


def _texts(array: Any) -> list[str | None]:
    return array.to_pylist()


def _jsonl(path: str, column: str) -> Iterator[tuple[list[str], int]]:
    documents, read = [], 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            read += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise InputError(f"dataset file {path!r} line {number} is not JSON ({err})", argument="dataset") from None
            if not isinstance(record, dict) or column not in record:
                raise InputError(f"dataset file {path!r} line {number} has no key {column!r}; name the text key with "
                                 f"--text-column", argument="dataset")
            text = record[column]
            if text is not None and not isinstance(text, str):
                raise InputError(f"dataset file {path!r} line {number}: {column!r} holds {type(text).__name__}, not "
                                 f"text; name the text key with --text-column", argument="dataset")
            documents.append(text)
            if len(documents) >= BATCH_ROWS:
                yield documents, read
                documents, read = [], 0
    yield documents, read


class _Progress:
    """A line on stderr each time another tenth of `total` bytes was read (`QUIET_BYTES` or less: none)."""

    def __init__(self, total: int):
        self.total, self.read, self.shown = max(total, 1), 0, 0 if total > QUIET_BYTES else 10

    def __call__(self, n: int) -> None:
        self.read += n
        tenth = min(10, self.read * 10 // self.total)
        if tenth > self.shown:
            self.shown = tenth
            print(f"jaxdp: tokenized {self.read / 1e9:.2f} of {self.total / 1e9:.2f} GB ({tenth * 10}%)",
                  file=sys.stderr, flush=True)
