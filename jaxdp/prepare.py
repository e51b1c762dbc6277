"""Encode a text file with a Hugging Face tokenizer into a .bin of token ids, for `--model gpt`.

    python -m jaxdp.prepare --input book.txt --tokenizer tokenizer.json --output book.bin
    python -m jaxdp.prepare --input book.txt --tokenizer tok.json --output book.bin --train-tokenizer 4096
    python -m jaxdp.train --model gpt --dataset book.bin --vocab-size 4096      # the size it prints

The .bin is nanoGPT's format: uint16 ids for a vocabulary up to 65536, uint32 above, the rule
`--vocab-size` makes jaxdp/data/tokens.py read by. The text is read and encoded in blocks (bounded
memory, with a progress bar over the bytes read) and cut only where the tokenizer would split
anyway (jaxdp/data/tokenizer.py); the .bin is written through a temporary file and a rename, so an
interrupted run leaves no half file. `--train-tokenizer N` first trains a byte-level BPE tokenizer
of N tokens (GPT-2's kind) on the text and writes it to the --tokenizer path. Nothing is written
over a file it does not own: --output and --tokenizer must not be the --input text (however the
paths are spelt) nor each other, and --train-tokenizer replaces only a tokenizer JSON file.

`--tokenizer` on `python -m jaxdp.train` does the same for a .txt dataset by itself, into a cache;
this command is for a .bin to copy elsewhere, or to keep beside the text.

Exit codes: 0 done, 2 bad input (one line on stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Sequence

from jaxdp.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, InputError, OneLineParser

FLAGS = {"tokenizer": "--tokenizer", "dataset": "--input", "vocab_size": "--train-tokenizer"}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m jaxdp.prepare", allow_abbrev=False,
                     description="Encode a UTF-8 text file with a Hugging Face tokenizer into a .bin of token ids "
                                 "(uint16, or uint32 above 65536 tokens) for python -m jaxdp.train --model gpt.")
    parser.add_argument("--input", required=True, metavar="TEXT_FILE", help="the UTF-8 text to encode")
    parser.add_argument("--tokenizer", required=True, metavar="TOKENIZER_JSON",
                        help="a Hugging Face tokenizers JSON file (written there with --train-tokenizer)")
    parser.add_argument("--output", required=True, metavar="OUT_BIN", help="the .bin of token ids to write")
    parser.add_argument("--train-tokenizer", type=int, metavar="VOCAB_SIZE",
                        help="first train a byte-level BPE tokenizer of this many tokens on --input and write it "
                             "to --tokenizer (replacing a tokenizer there, never another file)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return parser


def prepare(input_path: str, tokenizer_path: str, output: str, train_tokenizer: int | None = None,
            progress: bool = True) -> tuple[int, int]:
    """Encode `input_path` into the .bin `output`; returns (token count, vocabulary size)."""
    from jaxdp.data import tokenizer as tokenizer_lib

    if not os.path.isfile(input_path):
        raise InputError(f"text file {input_path!r} does not exist", argument="dataset")
    if not output.lower().endswith(".bin"):
        raise InputError(f"--output={output!r} must end in .bin (python -m jaxdp.train reads a .bin as token ids)")
    if os.path.isdir(output):
        raise InputError(f"--output={output!r} is a directory; give a file name ending in .bin")
    _check_clashes(input_path, tokenizer_path, output, train_tokenizer is not None)
    if train_tokenizer is not None:
        print(f"jaxdp.prepare: training a byte-level BPE tokenizer of {train_tokenizer} tokens on {input_path}",
              file=sys.stderr, flush=True)
        tokenizer_lib.train_bpe(input_path, train_tokenizer, tokenizer_path)
    tokenizer = tokenizer_lib.load(tokenizer_path)
    vocab_size = tokenizer.get_vocab_size()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=os.path.getsize(input_path), unit="B", unit_scale=True, unit_divisor=1024,
                   desc="tokenizing", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
    try:
        count = tokenizer_lib.encode_file(input_path, tokenizer, output, progress=bar.update if bar else None)
    except OSError as err:
        raise InputError(f"--output={output!r} cannot be written ({err.strerror or err})") from None
    finally:
        if bar is not None:
            bar.close()
    return count, vocab_size


def _same(a: str, b: str) -> bool:
    """Whether the paths name one file (however spelt: relative, through a link, a hard link)."""
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def _check_clashes(input_path: str, tokenizer_path: str, output: str, training: bool) -> None:
    """InputError unless every file this command writes is neither its input nor another's: the .bin
    replaces only a .bin, --train-tokenizer replaces only a tokenizer (or writes a new file)."""
    if _same(output, input_path):
        raise InputError(f"--output={output!r} is the --input text file; writing the ids there would destroy the "
                         f"text: give another .bin path")
    if _same(output, tokenizer_path):
        raise InputError(f"--output={output!r} is the --tokenizer file; writing the ids there would destroy the "
                         f"tokenizer: give another .bin path")
    if not training:
        return
    if _same(tokenizer_path, input_path):
        raise InputError(f"--tokenizer={tokenizer_path!r} is the --input text file; --train-tokenizer would write "
                         f"the tokenizer over the text: give the tokenizer a path of its own (e.g. tokenizer.json)")
    if os.path.isdir(tokenizer_path):
        raise InputError(f"--tokenizer={tokenizer_path!r} is a directory; --train-tokenizer writes a JSON file: "
                         f"give a file path (e.g. tokenizer.json)")
    if os.path.exists(tokenizer_path) and not _is_tokenizer(tokenizer_path):
        raise InputError(f"--tokenizer={tokenizer_path!r} exists and is not a Hugging Face tokenizers JSON file; "
                         f"--train-tokenizer replaces only a tokenizer: give a new path or remove that file")


def _is_tokenizer(path: str) -> bool:
    """Whether `path` holds a tokenizers JSON file (a JSON object with a "model"), read without the package."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(content, dict) and isinstance(content.get("model"), dict)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxdp.prepare ARGS`, returning the exit code."""
    try:
        args = build_parser().parse_args(argv)
        count, vocab_size = prepare(args.input, args.tokenizer, args.output, args.train_tokenizer, args.progress)
    except InputError as err:
        flag = FLAGS.get(err.argument or "")
        print(f"jaxdp.prepare: error: {flag + ': ' if flag else ''}{err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as err:  # a file that cannot be read or written: say which, in one line
        print(f"jaxdp.prepare: error: {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("jaxdp.prepare: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    dtype = "uint16" if vocab_size <= 1 << 16 else "uint32"
    print(f"wrote {count} token ids ({dtype}) to {args.output}; vocabulary size {vocab_size}: train with "
          f"python -m jaxdp.train --model gpt --dataset {shlex.quote(args.output)} --vocab-size {vocab_size}")
    return EXIT_OK


def cli() -> None:
    """The `jaxdp-prepare` script."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
