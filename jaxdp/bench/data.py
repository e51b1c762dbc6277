"""data: a corpus of JSON lines larger than you would hold in memory, tokenized once and trained on, with the
process's resident memory sampled throughout.

    python -m jaxdp.bench data --size 2GB                     # byte-level: vocabulary 256
    python -m jaxdp.bench data --size 256MB --tokenizer tok.json --steps 20 --json d.json

The corpus is made in a temporary directory from text nobody here wrote: every file of Python's standard
library sources (`--source`, default the running Python's `Lib`), one JSON object {"text": ...} per file
and line, read again and again until the JSONL files hold `--size` bytes (in `--files` files). Then
`--dataset DIR` goes through jaxdp's own path (jaxdp/data/corpus.py: streamed, tokenized once into the
token cache, a `$JAXDP_TOKEN_CACHE` inside the temporary directory) and a tiny GPT trains `--steps` steps
on it through `python -m jaxdp.train`'s `train`, in this process (the compilation cache off, so every run
compiles alike). A thread reads /proc/self/status every `INTERVAL_S`: the figures are the peak resident
set (VmRSS; RssAnon, the process's own memory, beside it: RssFile is pages of memory-mapped files, which
the kernel drops under pressure) before, while tokenizing and while training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from typing import Any

from jaxdp.bench.report import parse_size, print_table, write_json

INTERVAL_S = 0.05


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("data", help="a JSONL corpus of --size bytes tokenized and trained on: peak memory")
    p.add_argument("--size", default="2GB", help="bytes of JSONL to make, e.g. 256MB, 2GB")
    p.add_argument("--files", type=int, default=8, help="JSONL files the corpus is spread over")
    p.add_argument("--source", default=sysconfig.get_paths()["stdlib"], help="a folder of .py files: the documents")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizers JSON file (default: bytes)")
    p.add_argument("--steps", type=int, default=30, help="training steps of a tiny GPT on the tokens")
    p.add_argument("--keep", help="make the corpus in this folder and keep it (default: a temporary one)")
    p.add_argument("--json")
    p.set_defaults(run=run)


class Memory:
    """Samples this process's VmRSS and RssAnon on a thread; `phase(name)` starts a new phase's peaks."""

    def __init__(self) -> None:
        self.name, self.peaks, self.last = "start", {}, {}
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> dict[str, int]:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "RssAnon", "RssFile")))
        return {k: int(v.split()[0]) << 10 for k, v in fields.items()}

    def _sample(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self._record()

    def _record(self) -> None:
        with self._lock:
            self.last = sample = self.now()
            peak = self.peaks.setdefault(self.name, {})
            for key, value in sample.items():
                peak[key] = max(peak.get(key, 0), value)

    def phase(self, name: str) -> None:
        """Sampled as the last phase ends and as `name` begins: a phase shorter than INTERVAL_S
        (a small corpus tokenized on a busy machine) still has its peaks."""
        self._record()
        with self._lock:
            self.name = name
        self._record()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._record()  # the last phase's end


def make_corpus(folder: str, size: int, files: int, source: str) -> tuple[int, int]:
    """JSONL files in `folder` of `size` bytes in all, from the .py files under `source`; (bytes, documents)."""
    paths = sorted(os.path.join(root, n) for root, _, names in os.walk(source) for n in names if n.endswith(".py"))
    if not paths:
        raise SystemExit(f"jaxdp.bench: data: no .py file under {source!r}; give --source")
    written = documents = 0
    outs = [open(os.path.join(folder, f"part-{k:03d}.jsonl"), "w", encoding="utf-8") for k in range(files)]
    try:
        while written < size:
            for path in paths:
                with open(path, encoding="utf-8", errors="replace") as f:
                    line = json.dumps({"text": f.read(), "source": os.path.relpath(path, source)}) + "\n"
                outs[documents % files].write(line)
                written, documents = written + len(line.encode()), documents + 1
                if written >= size:
                    break
    finally:
        for out in outs:
            out.close()
    return written, documents


def run(args: argparse.Namespace) -> list[dict]:
    from jaxdp.config import parse_args
    from jaxdp.data.datasets import load_dataset
    from jaxdp.train import train

    size = parse_size(args.size)
    with tempfile.TemporaryDirectory(prefix="jaxdp-data-") as scratch:
        folder = args.keep or os.path.join(scratch, "corpus")
        os.makedirs(folder, exist_ok=True)
        cache_before = os.environ.get("JAXDP_TOKEN_CACHE")
        os.environ["JAXDP_TOKEN_CACHE"] = os.path.join(scratch, "cache")
        started = time.perf_counter()
        written, documents = make_corpus(folder, size, args.files, args.source)
        made_s = time.perf_counter() - started
        print(f"jaxdp.bench data: {written / 1e9:.2f} GB of JSONL, {documents} documents, in {folder} ({made_s:.0f} s)",
              file=sys.stderr, flush=True)
        memory = Memory()
        try:
            memory.phase("before")
            time.sleep(4 * INTERVAL_S)
            memory.phase("tokenizing")
            started = time.perf_counter()
            dataset = load_dataset(folder, seq_len=256, tokenizer=args.tokenizer)
            tokenize_s = time.perf_counter() - started
            tokens = len(dataset.tokens)
            del dataset
            memory.phase("training")
            started = time.perf_counter()
            flags = ["--model", "gpt", "--dataset", folder, "--layers", "2", "--d-model", "64", "--heads", "2",
                     "--seq-len", "256", "--batch-size", "64", "--steps", str(args.steps), "--no-progress",
                     "--log-every", str(max(1, args.steps)), "--eval-batches", "2", "--devices", "1", "--compile-cache", "off"]
            with warnings.catch_warnings():  # one CPU device on purpose
                warnings.filterwarnings("ignore", message="jaxdp.make_mesh: JAX sees one CPU device")
                result = train(parse_args([*flags, *(["--tokenizer", args.tokenizer] if args.tokenizer else [])]))
            train_s = time.perf_counter() - started
            time.sleep(4 * INTERVAL_S)
        finally:
            memory.close()
            if cache_before is None:
                os.environ.pop("JAXDP_TOKEN_CACHE")
            else:
                os.environ["JAXDP_TOKEN_CACHE"] = cache_before
    peaks = memory.peaks
    row = {"jsonl_bytes": written, "documents": documents, "tokens": tokens, "tokenize_s": tokenize_s,
           "tokenize_mb_s": written / tokenize_s / 1e6, "train_s": train_s, "steps": args.steps,
           "eval_loss": result.summary.get("eval_loss"),
           **{f"{phase}_{k.lower()}": v for phase in ("before", "tokenizing", "training") for k, v in peaks.get(phase, {}).items()}}
    print(f"{written / 1e9:.2f} GB of JSONL ({documents} documents, {tokens} tokens): tokenized in {tokenize_s:.0f} s "
          f"({row['tokenize_mb_s']:.0f} MB/s), {args.steps} training steps in {train_s:.0f} s; peak memory (MB):")
    print_table([{"phase": phase, **{k: v / 2**20 for k, v in peaks.get(phase, {}).items()}}
                 for phase in ("before", "tokenizing", "training")],
                [("phase", "phase", ""), ("VmRSS", "VmRSS", ".0f"), ("RssAnon", "RssAnon", ".0f"),
                 ("RssFile", "RssFile", ".0f")])
    write_json(args.json, [row], size=args.size, tokenizer=args.tokenizer)
    return [row]
