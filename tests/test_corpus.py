"""--dataset as documents: folders and globs of Parquet, Arrow (file and stream), JSON lines, a saved Hugging Face
dataset (jaxdp/data/corpus.py), tokenized once into the token cache, trained on with exact resume.

The reference is the same text in a .txt file: each document followed by a newline, read as bytes."""

from __future__ import annotations

import json
import math
import os
import shutil

import jax
import numpy as np
import pytest

from jaxdp.config import ConfigError, parse_args
from jaxdp.data import corpus, tokenizer as tokenizer_lib
from jaxdp.data.datasets import load_dataset
from jaxdp.errors import InputError
from jaxdp.train import train

pa = pytest.importorskip("pyarrow")
import pyarrow.feather  # noqa: E402
import pyarrow.parquet  # noqa: E402

# Documents with what a separator must not disturb: multi-byte characters, inner newlines, an empty one.
DOCS = [f"Document {i}: {'naïve café ' * (i % 5)}the end{chr(10) * (i % 3 == 0)}." for i in range(120)] + [""]
TINY_GPT = ["--model", "gpt", "--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16",
            "--batch-size", "8", "--no-progress", "--log-every", "1"]


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(tokenizer_lib.ENV_CACHE, str(tmp_path / "cache"))
    return tmp_path / "cache"


def write(folder, fmt: str, docs=DOCS, column: str = "text"):
    """`docs` in `folder` as `fmt`, in three files (one for the Hugging Face dataset), read in path order."""
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_dict({column: docs, "n": list(range(len(docs)))}).save_to_disk(str(folder))
        return folder
    parts = np.array_split(np.arange(len(docs)), 3)
    for k, rows in enumerate(parts):
        table = pa.table({"id": [int(r) for r in rows], column: [docs[r] for r in rows]})
        path = folder / f"part-{k}.{ {'jsonl': 'jsonl', 'parquet': 'parquet'}.get(fmt, 'arrow') }"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps({"id": int(r), column: docs[r]}) + "\n" for r in rows), encoding="utf-8")
        elif fmt == "parquet":
            pyarrow.parquet.write_table(table, path, row_group_size=7)
        elif fmt == "feather":
            pyarrow.feather.write_feather(table, path, chunksize=9)
        else:  # an Arrow stream (what save_to_disk writes)
            with pa.ipc.new_stream(str(path), table.schema) as writer:
                writer.write_table(table, max_chunksize=9)
    return folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same text in a .txt file, and the parameters after 2 steps on it."""
    path = tmp_path_factory.mktemp("text") / "all.txt"
    path.write_text("".join(d + "\n" for d in DOCS), encoding="utf-8")
    return path, train(parse_args([*TINY_GPT, "--dataset", str(path), "--steps", "2"])).state.params


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "feather", "stream", "hf"])
def test_each_format_trains_on_the_stream_of_the_same_text(tmp_path, fmt, reference, token_cache):
    text_file, params = reference
    folder = write(tmp_path / fmt, fmt)
    documents = load_dataset(str(folder), seq_len=16)
    assert documents.vocab_size == 256 and documents.tokens.dtype == np.uint8
    assert np.array_equal(np.asarray(documents.tokens), np.fromfile(text_file, np.uint8))
    run = train(parse_args([*TINY_GPT, "--dataset", str(folder), "--steps", "2"]))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), run.state.params, params)
    assert not [p for p in os.listdir(token_cache) if not p.endswith(".bin")]  # no .lock, no temporary file left


def test_a_glob_and_a_tokenizer_with_an_end_of_text_token(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tok.save(str(tmp_path / "tok.json"))
    write(tmp_path / "docs", "parquet")
    (tmp_path / "docs" / "notes.md").write_text("not data")
    dataset = load_dataset(str(tmp_path / "docs" / "*.parquet"), seq_len=16, tokenizer=str(tmp_path / "tok.json"))
    eot = tok.token_to_id("<|endoftext|>")
    expected = [i for d in DOCS for i in [*tok.encode(d, add_special_tokens=False).ids, eot]]
    assert dataset.vocab_size == tok.get_vocab_size() and np.array_equal(np.asarray(dataset.tokens), expected)
    with pytest.raises(InputError, match="notes.md.*narrow the pattern"):
        load_dataset(str(tmp_path / "docs" / "*"), seq_len=16)


def test_the_cache_is_reused_and_remade_when_a_file_changes(tmp_path, token_cache, monkeypatch):
    folder = write(tmp_path / "docs", "jsonl")
    first = np.asarray(load_dataset(str(folder), seq_len=16).tokens)
    (cached,) = token_cache.iterdir()
    made = cached.stat().st_mtime_ns

    def no_second_tokenization(*args, **kwargs):
        raise AssertionError("tokenized again")

    with monkeypatch.context() as patch:
        patch.setattr(corpus, "write_ids", no_second_tokenization)
        again = load_dataset(str(folder), seq_len=16)
    assert np.array_equal(np.asarray(again.tokens), first) and cached.stat().st_mtime_ns == made
    with open(folder / "part-2.jsonl", "a") as f:  # a changed file: tokenized again, the stale file removed
        f.write(json.dumps({"text": "one more"}) + "\n")
    load_dataset(str(folder), seq_len=16)
    assert [p.name for p in token_cache.iterdir()] != [cached.name] and len(list(token_cache.iterdir())) == 1


def test_no_lock_file_is_left_by_the_text_token_cache(tmp_path, token_cache):
    pytest.importorskip("tokenizers")
    text = tmp_path / "book.txt"
    text.write_text(" ".join(DOCS) * 3, encoding="utf-8")
    tokenizer_lib.train_bpe(str(text), 280, str(tmp_path / "tok.json"))
    load_dataset(str(text), seq_len=16, tokenizer=str(tmp_path / "tok.json"))
    assert [p.suffix for p in token_cache.iterdir()] == [".bin"]


@pytest.mark.slow  # two tiny GPT runs with checkpoints: about 20 s on 2 cores
def test_resume_from_a_checkpoint_is_bit_identical(tmp_path):
    folder = write(tmp_path / "docs", "parquet")
    flags = [*TINY_GPT, "--dataset", str(folder), "--save-every", "2", "--steps", "4", "--checkpoint-dir", str(tmp_path / "run")]
    whole = train(parse_args(flags))
    shutil.rmtree(tmp_path / "run" / "4")  # back to step 2
    resumed = train(parse_args(flags))
    assert [r["step"] for r in resumed.history] == [3, 4]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), resumed.state, whole.state)


def test_a_resume_on_changed_documents_is_refused_in_one_line(tmp_path, capsys):
    """Documents appended, or text edited in place, since the checkpoint: the held-out split (the stream's
    tail) would move over text already trained on. Exit 2, one line saying what changed; as it was, it resumes."""
    from jaxdp.train import main

    folder = write(tmp_path / "docs", "jsonl")
    flags = [*TINY_GPT, "--dataset", str(folder), "--checkpoint-dir", str(tmp_path / "run"), "--save-every", "2",
             "--eval-batches", "1"]
    assert main([*flags, "--steps", "2"]) == 0
    last, ids = folder / "part-2.jsonl", sum(len(d.encode()) + 1 for d in DOCS)
    original = last.read_text(encoding="utf-8")
    for text, change in ((original + json.dumps({"text": "one more"}) + "\n",
                          f"(it was trained on {ids} uint8 token ids, this run reads {ids + 9} uint8 token ids)"),
                         (original.replace("the end", "THE END", 1),  # the same size
                          f"(the same {ids} uint8 token ids, with other contents (edited in place))")):
        last.write_text(text, encoding="utf-8")
        capsys.readouterr()
        assert main([*flags, "--steps", "4"]) == 2
        err = capsys.readouterr().err
        (line,) = [line for line in err.splitlines() if "error" in line]
        assert "Traceback" not in err and line == (
            f"jaxdp: error: --checkpoint-dir: checkpoint directory '{tmp_path / 'run'}' holds a checkpoint (step 2) "
            f"trained on other data: dataset '{folder}' changed since {change}, so the held-out split would now hold "
            f"data already trained on; restore the data it was trained on, or start a new run in another checkpoint "
            f"directory")
    last.write_text(original, encoding="utf-8")
    assert main([*flags, "--steps", "4"]) == 0


def test_bad_documents_are_one_line_naming_the_dataset(tmp_path):
    folder = write(tmp_path / "docs", "parquet", column="body")
    os.makedirs(tmp_path / "empty")
    for path, column, words in ((folder, "text", "has no column 'text' .*--text-column"),
                                (folder, "id", "holds int64, not text"),
                                (tmp_path / "empty", "text", "holds no .parquet"),
                                (tmp_path / "none-*.jsonl", "text", "matches no file")):
        with pytest.raises(InputError, match=words) as err:
            load_dataset(str(path), seq_len=16, text_column=column)
        assert err.value.argument == "dataset" and "\n" not in str(err.value)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(InputError, match="line 2 has no key 'text'"):
        load_dataset(str(tmp_path / "bad"), seq_len=16)
    with pytest.raises(ConfigError, match="--model=gpt trains on a token stream"):
        parse_args(["--model", "gpt", "--dataset", str(tmp_path / "x.csv")])
    with pytest.raises(ConfigError, match="is a token stream, for --model=gpt"):
        parse_args(["--model", "mlp", "--dataset", str(folder)])


def test_without_pyarrow_a_parquet_folder_says_what_to_install(tmp_path, monkeypatch):
    folder = write(tmp_path / "docs", "parquet")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    with pytest.raises(InputError, match=r"needs pyarrow: pip install 'jaxdp-trainer\[data\]'"):
        load_dataset(str(folder), seq_len=16)


def test_sampling_a_run_on_documents_reads_bytes_even_when_the_folder_is_gone(tmp_path):
    from jaxdp import sample

    for dataset in (str(write(tmp_path / "docs", "jsonl")), "/gone/shards", "/gone/shards/*.parquet"):
        encode, decode = sample.codec_for({"dataset": dataset})
        assert encode("héllo") == list("héllo".encode()) and decode(encode("héllo")) == "héllo"
    for dataset in ("digits", "/data/x.npz"):
        with pytest.raises(InputError, match="not a language model"):
            sample.codec_for({"dataset": dataset})


def test_a_resumed_run_on_documents_keeps_its_text_column(tmp_path):
    from jaxdp.checkpoint.resume import resume_fields

    folder = write(tmp_path / "docs", "jsonl")
    assert resume_fields(parse_args(["--model", "gpt", "--dataset", str(folder), "--text-column", "body"]))["text_column"] == "body"
    assert "text_column" not in resume_fields(parse_args(["--model", "gpt", "--dataset", str(tmp_path / "a.txt")]))


def test_a_text_file_named_like_a_glob_is_still_a_text_file(tmp_path):
    path = tmp_path / "book[1].txt"
    path.write_text("".join(d + "\n" for d in DOCS), encoding="utf-8")
    dataset = load_dataset(str(path), seq_len=16)
    assert np.array_equal(np.asarray(dataset.tokens), np.fromfile(path, np.uint8))


# ---- hostile inputs: links, null texts, copies across the split -----------------------------------


def test_a_recursive_glob_through_a_link_loop_reads_each_file_once(tmp_path, capsys):
    """`DIR/**/*.jsonl` with `DIR/self -> .`: glob finds each file 41 times; each is read once, said in one line."""
    folder = write(tmp_path / "docs", "jsonl")
    os.symlink(".", folder / "self")
    once = np.asarray(load_dataset(str(folder), seq_len=16).tokens)
    capsys.readouterr()
    looped = load_dataset(str(folder / "**" / "*.jsonl"), seq_len=16)
    err = capsys.readouterr().err
    assert np.array_equal(np.asarray(looped.tokens), once)
    assert [line for line in err.splitlines() if "reading each file once" in line] == [
        f"jaxdp: --dataset {folder}/**/*.jsonl names 123 paths but only 3 different files (symbolic links lead to "
        f"the same files); reading each file once"]
    assert "held-out documents are copies" not in err


def held_out_copies(docs: list[str]) -> tuple[int, int]:
    """(held-out documents, how many of them are a training document's text too), counted the slow way:
    a document is held out when its bytes start in the last 10 % of the stream."""
    from jaxdp.data.tokens import HELD_OUT_FRACTION

    sizes = [len(d.encode()) + 1 for d in docs]
    starts, n_train = np.cumsum([0, *sizes])[:-1], sum(sizes) - math.ceil(sum(sizes) * HELD_OUT_FRACTION)
    training = {d for d, s in zip(docs, starts) if s < n_train}
    held = [d for d, s in zip(docs, starts) if s >= n_train and d.strip()]
    return len(held), sum(d in training for d in held)


def test_copies_of_training_documents_in_the_held_out_split_are_said(tmp_path, capsys):
    docs = DOCS[:100] + DOCS[10:30]  # the tail repeats documents trained on
    held, copies = held_out_copies(docs)
    assert copies > 3  # (the fixture has what the test needs)
    load_dataset(str(write(tmp_path / "docs", "parquet", docs=docs)), seq_len=16)
    lines = [line for line in capsys.readouterr().err.splitlines() if "held-out documents" in line]
    assert lines == [f"jaxdp: --dataset {tmp_path / 'docs'}: {copies} of the {held} held-out documents are copies of "
                     f"training documents (the same text), so the held-out loss overrates the model; remove the "
                     f"duplicate documents for a clean held-out split"]
    load_dataset(str(write(tmp_path / "unique", "jsonl")), seq_len=16)  # DOCS: no copies (and a blank one is none)
    assert "held-out documents" not in capsys.readouterr().err


def test_rows_with_a_null_text_are_left_out_in_one_line(tmp_path, capsys, token_cache):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in [*DOCS[:60], None, None]))
    pyarrow.parquet.write_table(pa.table({"text": [None, *DOCS[60:]]}), folder / "b.parquet")
    dataset = load_dataset(str(folder), seq_len=16)
    lines = [line for line in capsys.readouterr().err.splitlines() if "is null" in line]
    assert lines == [f"jaxdp: --dataset {folder}: left out 3 row(s) whose 'text' is null (2 in {folder / 'a.jsonl'}, "
                     f"1 in {folder / 'b.parquet'})"]
    assert np.array_equal(np.asarray(dataset.tokens), np.frombuffer("".join(d + "\n" for d in DOCS).encode(), np.uint8))
    assert not [p for p in os.listdir(token_cache) if not p.endswith(".bin")]  # the spilled digests are gone too


def test_a_dataset_link_that_leads_nowhere_is_one_line_and_exit_2(tmp_path, capsys):
    """A file that links to itself, in a folder or named itself, and a link to a missing file: exit 2, not 1."""
    from jaxdp.train import main

    loop = tmp_path / "a.jsonl"
    os.symlink("a.jsonl", loop)  # ln -s a.jsonl a.jsonl
    folder = write(tmp_path / "docs", "jsonl")
    os.symlink("loop.jsonl", folder / "loop.jsonl")
    gone = write(tmp_path / "gone", "jsonl")
    os.symlink(str(tmp_path / "moved.jsonl"), gone / "z.jsonl")
    for dataset, words in ((folder, f"dataset file '{folder / 'loop.jsonl'}' is a symbolic link that leads back"),
                           (loop, f"dataset file '{loop}' is a symbolic link that leads back to itself"),
                           (folder / "*.jsonl", f"dataset file '{folder / 'loop.jsonl'}' is a symbolic link that leads back"),
                           (gone, f"'{gone / 'z.jsonl'}' is a symbolic link to '{tmp_path / 'moved.jsonl'}', which "
                                  f"does not exist; point it at a data file or remove it")):
        code = main([*TINY_GPT, "--dataset", str(dataset), "--steps", "1"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and words in err[0], (dataset, code, err)
