"""Text through a Hugging Face `tokenizers` tokenizer into token ids, in bounded memory.

    python -m jaxdp.train --model gpt --dataset book.txt --tokenizer tokenizer.json   # cached once
    python -m jaxdp.prepare --input book.txt --tokenizer tokenizer.json --output book.bin

`encode_file` reads the text `BLOCK_BYTES` at a time and writes the ids to a nanoGPT-style .bin
(uint16 ids for a vocabulary up to 65536, uint32 above: `id_dtype`, the rule jaxdp/data/tokens.py reads
by), so a text of many GB never sits in memory, as text or as ids. The text is cut only where a
single space or newline stands between two non-space characters (`_CUTS`): byte-level BPE
(GPT-2's pre-tokenizer, and those like it) and whitespace pre-tokenizers split there anyway and
never merge across, so the ids equal those of the whole text encoded at once (a test checks it). No
special tokens are added (a BOS per chunk would be noise in the stream).

`cached_tokens` is what `--tokenizer` does for a `.txt` dataset: the ids, encoded once into a cache
file and memory-mapped like a .bin. The cache lives in `$JAXDP_TOKEN_CACHE`, else
`$XDG_CACHE_HOME/jaxdp/tokens`, else `~/.cache/jaxdp/tokens`, one file per (text file, tokenizer):
`<text name>-<digest>.bin`, the digest over the text's absolute path, size, modification time and a
sample of its bytes, and the tokenizer file's contents. A changed text or tokenizer gets a new file
(the stale one of the same text and tokenizer is removed); processes of one machine that start
together encode it once (a file lock, removed once the file is written: `build_once`), the others
wait and read it. Folders of documents (jaxdp/data/corpus.py) share the cache and the lock.
"""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import hashlib
import os
import re
import sys
from typing import Any, Callable, Iterator

import numpy as np

from jaxdp.errors import InputError

BLOCK_BYTES = 8 << 20     # text read per block: the memory bound (with its ids, about 4x this)
PIECE_CHARS = 1 << 11     # a block is cut into pieces of about this size for encode_batch: longer pieces encode
                          # slower on a byte-level BPE (docs/performance.md, "Behind the defaults")
MAX_CARRY_CHARS = 64 << 20  # text with no cut point this long (no spaces at all) is encoded as it is
ENV_CACHE = "JAXDP_TOKEN_CACHE"
INSTALL_HINT = "pip install 'jaxdp-trainer[tokenizers]'"

# Where the text may be cut: before a single space or newline between two non-space characters.
_CUTS = re.compile(r"(?<=\S)(?=[ \n]\S)")


def id_dtype(vocab_size: int) -> np.dtype:
    """The dtype of a .bin of ids for `vocab_size`: uint16 up to 65536, uint32 above (nanoGPT's)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def load(path: str) -> Any:
    """The `tokenizers.Tokenizer` in the JSON file `path` (InputError, argument "tokenizer", if the
    package is missing or the file is not a tokenizer)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise InputError(f"a tokenizer needs the tokenizers package: {INSTALL_HINT}", argument="tokenizer") from None
    if not os.path.isfile(path):
        raise InputError(f"tokenizer file {path!r} does not exist", argument="tokenizer")
    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for bad JSON
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise InputError(f"tokenizer file {path!r} is not a Hugging Face tokenizers JSON file ({reason})",
                         argument="tokenizer") from None


def train_bpe(text_path: str, vocab_size: int, out_path: str) -> Any:
    """Train a byte-level BPE tokenizer (GPT-2's kind: every byte is a token, so any text encodes)
    of `vocab_size` tokens on the text file, line by line, and write it to `out_path` atomically."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise InputError(f"training a tokenizer needs the tokenizers package: {INSTALL_HINT}") from None
    if vocab_size < 257:
        raise InputError(f"a byte-level BPE tokenizer needs a vocabulary of at least 257 (256 bytes and a "
                         f"merge), got {vocab_size}", argument="vocab_size")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def lines() -> Iterator[str]:
        with open(text_path, encoding="utf-8", errors="replace", newline="") as f:
            yield from f

    tokenizer.train_from_iterator(lines(), trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = f"{out_path}.tmp-{os.getpid()}"
    tokenizer.save(tmp)
    os.replace(tmp, out_path)
    return tokenizer


def byte_level_json() -> str:
    """A `tokenizers` tokenizer.json whose ids are the text's UTF-8 bytes, what a .txt --dataset
    without --tokenizer trains on: GPT-2's byte-level pre-tokenizer and decoder (each byte a printable
    stand-in character: `_byte_chars`) over a vocabulary of the 256 bytes, with no merges. It is what
    `python -m jaxdp.export` ships beside a byte-level model, so `AutoTokenizer.from_pretrained(OUT)`
    encodes as the run did. Written out as JSON: no `tokenizers` needed to write it."""
    import json

    chars = _byte_chars()
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {chars[b]: b for b in range(256)}, "merges": []}}, ensure_ascii=False, indent=1)


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character table: printable bytes stand for themselves, the other 68 for the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _last_cut(text: str) -> int:
    """The last cut point in `text`, or 0 if it has none."""
    for window in (1 << 16, len(text)):
        cut = 0
        for match in _CUTS.finditer(text, max(0, len(text) - window)):
            cut = match.start()
        if cut:
            return cut
    return 0


def _pieces(text: str, size: int) -> list[str]:
    """`text` cut at cut points into pieces of about `size` characters (encode_batch's threads)."""
    pieces, start = [], 0
    while len(text) - start > size:
        match = _CUTS.search(text, start + size)
        if match is None:
            break
        pieces.append(text[start:match.start()])
        start = match.start()
    pieces.append(text[start:])
    return pieces


def encode_file(text_path: str, tokenizer: Any, out_path: str, *, progress: Callable[[int], None] | None = None,
                block_bytes: int = BLOCK_BYTES, piece_chars: int = PIECE_CHARS) -> int:
    """Encode the UTF-8 text file into a .bin of ids (dtype `id_dtype`) at `out_path`, written
    through a temporary file and a rename; returns the number of ids. `progress(n)` is told each
    time n more bytes of the text were read. InputError if the text is not UTF-8."""
    dtype = id_dtype(tokenizer.get_vocab_size())
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    tmp = f"{out_path}.tmp-{os.getpid()}"
    count, read, carry = 0, 0, ""
    try:
        with open(text_path, "rb") as source, open(tmp, "wb") as out:
            while True:
                block = source.read(block_bytes)
                try:
                    text = carry + decoder.decode(block, final=not block)
                except UnicodeDecodeError as err:
                    raise InputError(f"text file {text_path!r} is not UTF-8 (byte {read + err.start}: {err.reason}); "
                                     f"convert it, e.g. with iconv", argument="dataset") from None
                read += len(block)
                cut = len(text) if not block else _last_cut(text)
                if block and not cut and len(text) >= MAX_CARRY_CHARS:
                    cut = len(text)  # no cut point in 64M characters: not prose; encode as it is
                carry, text = text[cut:], text[:cut]
                if text:
                    encodings = tokenizer.encode_batch(_pieces(text, piece_chars), add_special_tokens=False)
                    ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings])
                    ids.astype(dtype).tofile(out)
                    count += len(ids)
                if progress is not None and block:
                    progress(len(block))
                if not block:
                    break
        os.replace(tmp, out_path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    return count


def cache_dir() -> str:
    """Where `cached_tokens` keeps its files (see the module docstring)."""
    if os.environ.get(ENV_CACHE):
        return os.path.expanduser(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxdp", "tokens")


def cache_path(text_path: str, tokenizer_path: str) -> str:
    """The cache file of `text_path` encoded by `tokenizer_path`, as it is now (see the module docstring)."""
    from jaxdp.data.digest import sample_digest

    text_path = os.path.realpath(text_path)
    stat = os.stat(text_path)
    sample = sample_digest(np.memmap(text_path, dtype=np.uint8, mode="r")) if stat.st_size else ""
    with open(tokenizer_path, "rb") as f:
        tokenizer_digest = hashlib.sha256(f.read()).hexdigest()
    which = hashlib.sha256(f"{text_path}\0{tokenizer_digest}".encode()).hexdigest()[:12]
    version = hashlib.sha256(f"{stat.st_size}\0{stat.st_mtime_ns}\0{sample}".encode()).hexdigest()[:12]
    name = re.sub(r"[^\w.-]", "_", os.path.splitext(os.path.basename(text_path))[0])[:40]
    return os.path.join(cache_dir(), f"{name}-{which}-{version}.bin")


def cached_tokens(text_path: str, tokenizer_path: str, tokenizer: Any = None, announce: bool = True) -> np.ndarray:
    """The ids of `text_path` under the tokenizer in `tokenizer_path` (`tokenizer`: that file, loaded
    already), memory-mapped; encoded into the cache first if they are not there yet."""
    tokenizer = load(tokenizer_path) if tokenizer is None else tokenizer
    vocab_size = tokenizer.get_vocab_size()
    path = cache_path(text_path, tokenizer_path)

    def encode(path: str) -> None:
        if announce:
            print(f"jaxdp: tokenizing {text_path} with {tokenizer_path} (once; cached as {path})", file=sys.stderr, flush=True)
        encode_file(text_path, tokenizer, path)

    build_once(path, encode, argument="tokenizer")
    if os.path.getsize(path) == 0:
        return np.zeros(0, id_dtype(vocab_size))
    return np.memmap(path, dtype=id_dtype(vocab_size), mode="r")


def build_once(path: str, build: Callable[[str], None], argument: str) -> None:
    """Make the cache file `path` with `build(path)` (which writes it through a rename) unless it is there.

    Processes of one machine that start together build it once: the first takes a lock on `path.lock`,
    the others wait, then find the file. The lock file is removed as soon as the file is there (or its
    build failed), so none is left behind; the lock only saves work, the rename keeps the file whole."""
    if os.path.exists(path):
        return
    lock_path = path + ".lock"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process of this machine may be building it
            try:
                if not os.path.exists(path):
                    build(path)
                    _remove_stale(path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(lock_path)
    except OSError as err:
        raise InputError(f"cannot write the token cache {path!r} ({err.strerror or err}); set ${ENV_CACHE} to "
                         f"a writable directory", argument=argument) from None


def _remove_stale(path: str) -> None:
    """Remove the cache files of earlier versions of the same text under the same tokenizer."""
    directory, name = os.path.split(path)
    prefix = name.rsplit("-", 1)[0] + "-"
    for other in os.listdir(directory):
        if other.startswith(prefix) and other.endswith(".bin") and other != name:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, other))
