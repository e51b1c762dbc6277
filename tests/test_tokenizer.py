"""--tokenizer and python -m jaxdp.prepare: text through a Hugging Face tokenizer, in bounded memory.

The chunked encoder must give exactly the ids of the whole text encoded at once; the training run's
cache is made once and found again; bad input is one line (exit 2)."""

from __future__ import annotations

import os
import shlex

import numpy as np
import pytest

from jaxdp.config import Config, ConfigError, config_toml
from jaxdp.data import tokenizer as tokenizer_lib
from jaxdp.data.datasets import load_dataset
from jaxdp.errors import InputError

pytest.importorskip("tokenizers")

# Prose with what a cut must respect: runs of blank lines, double spaces, tabs, indentation,
# multi-byte characters (split across blocks by small block sizes), a last line without a newline.
TEXT = ("The quick brown fox jumps over the lazy dog.  Twice!\n\n\nA second paragraph, with\ttabs and"
        "   spaces.\n    indented line\nhéllo wörld, naïve café; 日本語のテキスト です。\n" * 40 + "no newline at the end")


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(tokenizer_lib.ENV_CACHE, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def text_and_tokenizer(tmp_path):
    text = tmp_path / "book.txt"
    text.write_text(TEXT, encoding="utf-8")
    tokenizer_lib.train_bpe(str(text), 300, str(tmp_path / "tok.json"))
    return text, tmp_path / "tok.json"


def test_chunked_encoding_equals_the_whole_text_encoded_at_once(tmp_path, text_and_tokenizer):
    text, path = text_and_tokenizer
    tokenizer = tokenizer_lib.load(str(path))
    whole = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert len(whole) > 1000 and max(whole) >= 256  # merges were learnt
    for block, piece in [(1 << 20, 1 << 11), (97, 13), (5, 3)]:
        count = tokenizer_lib.encode_file(str(text), tokenizer, str(tmp_path / "out.bin"), block_bytes=block,
                                          piece_chars=piece)
        ids = np.fromfile(tmp_path / "out.bin", np.uint16)
        assert count == len(whole) and np.array_equal(ids, whole), (block, piece)
    assert tokenizer.decode(ids.tolist()) == TEXT


def test_id_dtype_is_the_rule_bin_files_are_read_by():
    assert tokenizer_lib.id_dtype(65536) == np.uint16 and tokenizer_lib.id_dtype(65537) == np.uint32


def test_a_text_dataset_with_a_tokenizer_is_encoded_once_into_the_cache(text_and_tokenizer, token_cache, monkeypatch):
    text, path = text_and_tokenizer
    dataset = load_dataset(str(text), seq_len=16, tokenizer=str(path))
    assert dataset.vocab_size == 300 and dataset.tokens.dtype == np.uint16
    whole = tokenizer_lib.load(str(path)).encode(TEXT, add_special_tokens=False).ids
    assert np.array_equal(np.asarray(dataset.tokens), whole)
    (cached,) = [p for p in token_cache.iterdir() if p.suffix == ".bin"]

    def no_second_encoding(*args, **kwargs):
        raise AssertionError("the cache was not found again")

    monkeypatch.setattr(tokenizer_lib, "encode_file", no_second_encoding)
    again = load_dataset(str(text), seq_len=16, tokenizer=str(path), vocab_size=320)  # a padded vocabulary
    assert again.vocab_size == 320 and np.array_equal(np.asarray(again.tokens), whole)
    monkeypatch.undo()
    monkeypatch.setenv(tokenizer_lib.ENV_CACHE, str(token_cache))

    text.write_text(TEXT + " and more", encoding="utf-8")  # a new version: encoded again, the stale one removed
    load_dataset(str(text), seq_len=16, tokenizer=str(path))
    (fresh,) = [p for p in token_cache.iterdir() if p.suffix == ".bin"]
    assert fresh != cached


def test_bad_tokenizer_input_is_one_line_naming_the_tokenizer(tmp_path, text_and_tokenizer):
    text, path = text_and_tokenizer
    (tmp_path / "bad.json").write_text("{not json")
    for bad, words in ((tmp_path / "bad.json", "not a Hugging Face tokenizers JSON file"),
                       (tmp_path / "missing.json", "does not exist")):
        with pytest.raises(InputError, match=words) as err:
            load_dataset(str(text), seq_len=16, tokenizer=str(bad))
        assert err.value.argument == "tokenizer" and "\n" not in str(err.value)
    np.zeros(100, np.uint16).tofile(tmp_path / "ids.bin")
    with pytest.raises(InputError, match="not a .txt file") as err:
        load_dataset(str(tmp_path / "ids.bin"), seq_len=16, vocab_size=300, tokenizer=str(path))
    assert err.value.argument == "tokenizer"
    with pytest.raises(InputError, match="has 300 tokens") as err:
        load_dataset(str(text), seq_len=16, vocab_size=200, tokenizer=str(path))
    assert err.value.argument == "vocab_size"


def test_config_refuses_a_tokenizer_without_text_and_records_it_absolute(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="--tokenizer encodes text"):
        Config(model="gpt", dataset="ids.bin", vocab_size=300, tokenizer="tok.json")
    monkeypatch.chdir(tmp_path)
    config = Config(model="gpt", dataset="book.txt", tokenizer="tok.json")
    assert config.tokenizer == str(tmp_path / "tok.json")
    assert f"tokenizer = \"{tmp_path / 'tok.json'}\"" in config_toml(config)


def test_prepare_writes_the_bin_and_says_the_vocabulary_size(tmp_path, capsys):
    from jaxdp import prepare

    text = tmp_path / "book.txt"
    text.write_text(TEXT, encoding="utf-8")
    out, tok = tmp_path / "out" / "book.bin", tmp_path / "tok.json"
    assert prepare.main(["--input", str(text), "--tokenizer", str(tok), "--output", str(out),
                         "--train-tokenizer", "300"]) == 0
    said = capsys.readouterr()
    assert f"--dataset {shlex.quote(str(out))} --vocab-size 300" in said.out
    assert "100%" in said.err  # the progress bar over the bytes read
    whole = tokenizer_lib.load(str(tok)).encode(TEXT, add_special_tokens=False).ids
    assert np.array_equal(np.fromfile(out, np.uint16), whole)
    assert [p.name for p in out.parent.iterdir()] == ["book.bin"]  # written through a rename: no leftovers

    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe not UTF-8")
    for args, words in ((["--input", str(text), "--tokenizer", str(tmp_path / "no.json"), "--output", str(out)],
                         "--tokenizer: tokenizer file"),
                        (["--input", str(tmp_path / "bad.txt"), "--tokenizer", str(tok), "--output", str(out)],
                         "--input: text file"),
                        (["--input", str(text), "--tokenizer", str(tok), "--output", str(tmp_path / "x.npy")],
                         "must end in .bin"),
                        (["--input", str(text), "--tokenizer", str(tok)], "required: --output")):
        assert prepare.main([*args, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    assert os.listdir(out.parent) == ["book.bin"]


@pytest.mark.slow  # two tiny GPT runs: about 20 s
def test_docs_tokenizer_commands(tmp_path):
    """docs/training.md's prepare-and-train block, shrunk: the .bin and the cache give the same run."""
    from helpers import commands, readme_blocks, records, run_shell, sandbox

    (block,) = readme_blocks("tests/test_tokenizer.py::test_docs_tokenizer_commands")
    shown = commands(block)
    assert shown[1].startswith("python -m jaxdp.prepare") and len(shown) == 4
    env = {**sandbox(tmp_path), tokenizer_lib.ENV_CACHE: str(tmp_path / "cache")}
    shrink = ["--steps", "4", "--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size",
              "8", "--eval-batches", "2", "--no-progress", "--devices", "2"]
    for command in shown[:2]:
        run_shell(command.replace("2048", "300"), tmp_path, env)
    losses = []
    for command in shown[2:]:
        run_shell(shlex.join([*shlex.split(command.replace("2048", "300")), *shrink]), tmp_path, env)
        losses.append([r["loss"] for r in records(tmp_path / "bpe.jsonl") if "event" not in r])
    assert losses[0] == losses[1] and len(losses[0]) == 1  # the same ids, the same run (one log point at step 4)


def test_prepare_never_writes_over_its_input_or_a_file_it_does_not_own(tmp_path, capsys, monkeypatch):
    """A mistyped path (the text given as --tokenizer, or as --output) is one line and exit 2, and every
    file is left byte for byte as it was; the same file by another spelling or a link counts too."""
    from jaxdp import prepare

    monkeypatch.chdir(tmp_path)
    text = tmp_path / "book.txt"
    text.write_text(TEXT, encoding="utf-8")
    notes = tmp_path / "notes.json"
    notes.write_text('{"not": "a tokenizer"}')
    (tmp_path / "linked.bin").symlink_to(text)
    (tmp_path / "text.bin").write_text(TEXT, encoding="utf-8")  # a text that happens to end in .bin
    assert prepare.main(["--input", str(text), "--tokenizer", "tok.bin", "--output", "ids.bin",
                         "--train-tokenizer", "300", "--no-progress"]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    cases = [
        ([str(text), str(text), "ids.bin", "300"], "--tokenizer='" + str(text) + "' is the --input text file"),
        ([str(text), "./book.txt", "ids.bin", "300"], "--tokenizer='./book.txt' is the --input text file"),
        ([str(text), str(notes), "ids.bin", "300"], "exists and is not a Hugging Face tokenizers JSON file"),
        ([str(text), str(tmp_path), "ids.bin", "300"], "is a directory; --train-tokenizer writes a JSON file"),
        (["text.bin", "tok.bin", "text.bin", None], "--output='text.bin' is the --input text file"),
        ([str(text), "tok.bin", "linked.bin", None], "--output='linked.bin' is the --input text file"),
        ([str(text), "tok.bin", "tok.bin", None], "--output='tok.bin' is the --tokenizer file"),
        ([str(text), "new.bin", "new.bin", "300"], "--output='new.bin' is the --tokenizer file"),
    ]
    for (source, tokenizer, output, vocab), words in cases:
        argv = ["--input", source, "--tokenizer", tokenizer, "--output", output, "--no-progress"]
        assert prepare.main([*argv, *(["--train-tokenizer", vocab] if vocab else [])]) == 2, argv
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1 and err.startswith("jaxdp.prepare: error: "), (argv, err)
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before, argv  # nothing written, nothing new
