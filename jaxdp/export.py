"""Export a trained run's model for use outside jaxdp.

    python -m jaxdp.export --checkpoint-dir /tmp/run --format hf /tmp/run-hf
    python -m jaxdp.export --checkpoint-dir /tmp/run --format hf /tmp/run-hf --step 200

`--format hf` writes a Hugging Face GPT-2 directory (config.json + model.safetensors) that
`transformers.GPT2LMHeadModel.from_pretrained(OUT)` loads, from a `--model gpt` run
(`jaxdp.models.hf.write_gpt2`; what GPT-2 cannot express is refused). Beside them, tokenizer.json: the
run's --tokenizer, or for a text read as bytes the byte-level one whose ids are the UTF-8 bytes
(`jaxdp.data.tokenizer.byte_level_json`); `transformers.AutoTokenizer.from_pretrained(OUT)` loads it.
The model comes from the run's checkpoint
(`jaxdp.checkpoint.artifacts.load_model`: the latest step, or --step).

Exit codes (jaxdp/errors.py): 0 success, 1 an unexpected error, 2 bad input (one line on stderr;
--debug for the traceback).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tomllib
from typing import Any, Sequence

from jaxdp.errors import EXIT_OK, InputError, OneLineParser, run_tool

FORMATS = ("hf",)  # hf: a Hugging Face GPT-2 directory


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m jaxdp.export", allow_abbrev=False,
                     description="Write the model of a jaxdp run's checkpoint in another library's format.")
    parser.add_argument("out", metavar="OUT", help="the directory to write (made if missing)")
    parser.add_argument("--checkpoint-dir", required=True, metavar="PATH",
                        help="the --checkpoint-dir of a python -m jaxdp.train run")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="hf: a Hugging Face GPT-2 directory (config.json + model.safetensors)")
    parser.add_argument("--step", type=int, default=None, metavar="STEP",
                        help="the checkpoint step to export (default: the latest)")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    return parser


def export(checkpoint_dir: str, out: str, step: int | None = None) -> bool:
    """Write checkpoint `step` (default: the latest) of the run in `checkpoint_dir` to `out` as GPT-2,
    with its tokenizer where the run had one (returns whether it did)."""
    from jaxdp.models import hf

    if os.path.exists(out) and not os.path.isdir(out):
        raise InputError(f"OUT {out!r} is a file, not a directory; name a directory to write")
    module, params = _load_model(checkpoint_dir, step)
    try:
        hf.write_gpt2(module, params, out)
    except InputError as err:
        raise InputError(f"the model of {checkpoint_dir!r} cannot be written as GPT-2: {err}") from None
    return _write_tokenizer(checkpoint_dir, os.path.join(out, "tokenizer.json"))


def _write_tokenizer(checkpoint_dir: str, path: str) -> bool:
    """The run's tokenizer as `path`: its --tokenizer file, or for a text read as bytes the byte-level
    one (ids = UTF-8 bytes). Returns whether one was written (token ids from a .bin or .npy file come
    with no tokenizer jaxdp knows)."""
    from jaxdp.config import is_corpus
    from jaxdp.data.tokenizer import byte_level_json

    config_path = os.path.join(checkpoint_dir, "config.toml")
    recorded = {}
    if os.path.isfile(config_path):
        with open(config_path, "rb") as f:
            recorded = tomllib.load(f)
    tokenizer, dataset = recorded.get("tokenizer"), str(recorded.get("dataset", ""))
    if tokenizer and os.path.isfile(tokenizer):
        shutil.copyfile(tokenizer, path)
        return True
    if not tokenizer and (dataset.lower().endswith(".txt") or is_corpus(dataset)):
        with open(path, "w", encoding="utf-8") as f:
            f.write(byte_level_json())
        return True
    return False


def _load_model(checkpoint_dir: str, step: int | None) -> tuple[Any, Any]:
    from jaxdp.checkpoint.artifacts import load_model

    return load_model(checkpoint_dir, step)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxdp.export ARGS`, returning the exit code (jaxdp/errors.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        args = build_parser().parse_args(argv)
        tokenizer = export(args.checkpoint_dir, args.out, args.step)
        print(f"wrote {args.out} (config.json, model.safetensors{', tokenizer.json' if tokenizer else ''}): "
              f"transformers.GPT2LMHeadModel.from_pretrained({args.out!r}) loads it"
              + (f", AutoTokenizer.from_pretrained({args.out!r}) its tokenizer" if tokenizer else ""))
        return EXIT_OK

    return run_tool(body, debug="--debug" in argv,
                    describe=lambda err: f"--checkpoint-dir: {err}" if err.argument == "directory" else str(err))

if __name__ == "__main__":
    sys.exit(main())
