"""Sample text from a trained language model run, on one device.

    python -m jaxdp.sample --checkpoint-dir /tmp/run --prompt "ROMEO:" --max-new-tokens 200
    python -m jaxdp.sample --checkpoint-dir /tmp/run --prompt "ROMEO:" --temperature 0      # greedy
    python -m jaxdp.sample --checkpoint-dir /tmp/ids-run --prompt-ids 17,4,99 --top-k 40     # token ids in

The model and its parameters come from the run's checkpoint (`jaxdp.checkpoint.artifacts.load_model`: the
latest step, or --step); the prompt is encoded as the run's data was (`codec_for`): UTF-8 bytes for
a `.txt` run, the run's tokenizer for a run with `--tokenizer`, and for a run on token ids (.bin,
.npy) without one, ids given with --prompt-ids. The continuation alone is printed, decoded the same
way (bytes that are not UTF-8 as U+FFFD; for an id run, the ids). A prompt longer than the model's
context keeps its last tokens (a note on stderr says so). Generation is `jaxdp.models.generate.generate`:
with a key/value cache for the built-in GPT, a full forward pass per token for any other model.

Exit codes (jaxdp/errors.py): 0 success, 1 an unexpected error, 2 bad input (one line on stderr;
--debug for the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from typing import Any, Callable, Mapping, Sequence

from jaxdp.config import is_corpus
from jaxdp.registry import DATASETS
from jaxdp.errors import EXIT_OK, InputError, OneLineParser, run_tool

Encode = Callable[[str], list[int]]
Decode = Callable[[Sequence[int]], str]

# Which flag fed each library argument an InputError may name.
FLAG_OF_ARGUMENT = {"directory": "--checkpoint-dir", "max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
                    "top_k": "--top-k", "seed": "--seed", "prompt_ids": "--prompt-ids", "prompt": "--prompt"}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m jaxdp.sample", allow_abbrev=False,
                     description="Continue a prompt with the language model of a jaxdp run's checkpoint.")
    parser.add_argument("--checkpoint-dir", required=True, metavar="PATH",
                        help="the --checkpoint-dir of a python -m jaxdp.train run (its config.toml and checkpoints)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the text to continue, encoded as the run's data was")
    prompt.add_argument("--prompt-ids", metavar="ID,ID,...",
                        help="the prompt as token ids, comma-separated (for a run on token ids without a tokenizer)")
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help="tokens to generate (default: 200)")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="T",
                        help="sampling temperature; 0: greedy, the most likely token every time (default: 1.0)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="sample among the K most likely tokens only (default: all)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the random draws (default: 0)")
    parser.add_argument("--step", type=int, default=None, metavar="STEP",
                        help="the checkpoint step to load (default: the latest)")
    parser.add_argument("--tokenizer", metavar="PATH", default=None,
                        help="a Hugging Face tokenizers JSON to encode and decode with, for a run on a .bin made by "
                             "python -m jaxdp.prepare (default: the run's own --tokenizer, else bytes for a .txt run)")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    return parser


# ---- the run's tokens ----------------------------------------------------------------------------


def run_config(checkpoint_dir: str) -> dict[str, Any]:
    """The run's config.toml (flag names as keys), which `python -m jaxdp.train` writes beside its checkpoints."""
    path = os.path.join(checkpoint_dir, "config.toml")
    if not os.path.isdir(checkpoint_dir):
        raise InputError(f"checkpoint directory {checkpoint_dir!r} does not exist", argument="directory")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise InputError(f"checkpoint directory {checkpoint_dir!r} has no config.toml; it is not the directory of a "
                         f"python -m jaxdp.train run", argument="directory") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path} is not a readable TOML file ({err})", argument="directory") from None


def codec_for(config: Mapping[str, Any]) -> tuple[Encode, Decode]:
    """(encode, decode) between text and the token ids a run trained on, from its config (config.toml
    as a dict): its tokenizer (a Hugging Face `tokenizers` JSON file) if it has one, else UTF-8 bytes
    for a `.txt` dataset. A run on token ids (.bin, .npy) without a tokenizer cannot encode text:
    its `encode` raises InputError (pass ids instead), its `decode` writes the ids."""
    tokenizer_path = config.get("tokenizer")
    if tokenizer_path:
        from tokenizers import Tokenizer

        if not os.path.isfile(tokenizer_path):
            raise InputError(f"the run's tokenizer {tokenizer_path!r} does not exist (any more)", argument="directory")
        tokenizer = Tokenizer.from_file(tokenizer_path)
        # as the training stream was encoded (jaxdp/data/tokenizer.py): no special tokens added
        return ((lambda text: tokenizer.encode(text, add_special_tokens=False).ids),
                (lambda ids: tokenizer.decode([int(i) for i in ids])))
    dataset = str(config.get("dataset", ""))
    if dataset.lower().endswith(".txt") or is_corpus(dataset) or (dataset and dataset not in DATASETS and not
                                                                 dataset.lower().endswith((".bin", ".npy", ".npz"))):
        return _encode_bytes, _decode_bytes  # text as bytes (documents too: jaxdp/data/corpus.py, a folder moved since)
    if dataset.lower().endswith((".bin", ".npy")):
        def refuse(text: str) -> list[int]:
            raise InputError(f"the run trained on token ids ({os.path.basename(dataset)}) and has no tokenizer, so "
                             f"text cannot be encoded; give the prompt as ids with --prompt-ids 1,2,3",
                             argument="prompt")
        return refuse, lambda ids: " ".join(str(int(i)) for i in ids)
    raise InputError(f"the run trained on {dataset!r}, not a token stream (.txt, .bin, .npy): it is not a language "
                     f"model", argument="directory")


def _encode_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _decode_bytes(ids: Sequence[int]) -> str:
    """Bytes to text; an id that is not a byte (a model with more than 256 tokens) becomes U+FFFD."""
    replacement = "\ufffd".encode("utf-8")
    return b"".join(bytes([i]) if 0 <= i < 256 else replacement for i in map(int, ids)).decode("utf-8", errors="replace")


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise InputError(f"--prompt-ids must be comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids:
        raise InputError("--prompt-ids is empty; give at least one token id")
    return ids


# ---- the command ---------------------------------------------------------------------------------


def sample(args: argparse.Namespace) -> str:
    """The continuation the flags ask for, decoded."""
    from jaxdp.models.generate import check_options, generate, model_context

    check_options(args.max_new_tokens, args.temperature, args.top_k, args.seed)  # before the model loads
    config = run_config(args.checkpoint_dir)
    if args.tokenizer:
        config = {**config, "tokenizer": os.path.abspath(args.tokenizer)}
    encode, decode = codec_for(config)
    prompt = parse_ids(args.prompt_ids) if args.prompt_ids is not None else encode(args.prompt)
    if not prompt:
        raise InputError("--prompt is empty; give some text to continue")

    module, params = _load_model(args.checkpoint_dir, args.step)
    context = model_context(module) or config.get("seq-len")  # a --model MODULE:ATTR may have no seq_len field
    if context is not None and len(prompt) > context:
        print(f"jaxdp: the prompt has {len(prompt)} tokens, more than the model's context of {context}: only its last "
              f"{context} are used", file=sys.stderr)
    new = generate(module, params, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   seed=args.seed, context=context)
    return decode(new.tolist())


def _load_model(checkpoint_dir: str, step: int | None) -> tuple[Any, Any]:
    from jaxdp.checkpoint.artifacts import load_model

    return load_model(checkpoint_dir, step)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxdp.sample ARGS`, returning the exit code (jaxdp/errors.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        print(sample(build_parser().parse_args(argv)))
        return EXIT_OK

    return run_tool(body, debug="--debug" in argv, describe=cli_message,
                    memory_advice="; lower --max-new-tokens (the key/value cache grows with it) or sample on a larger device")

def cli_message(err: InputError) -> str:
    """A library's InputError in flag terms: "temperature must be ..." as "--temperature must be ...",
    other messages prefixed with the flag that fed the argument they name."""
    message, argument = str(err), err.argument or ""
    flag = FLAG_OF_ARGUMENT.get(argument)
    if flag and message.startswith(argument + " "):
        return flag + message[len(argument):]
    return f"{flag}: {message}" if flag else message


if __name__ == "__main__":
    sys.exit(main())
