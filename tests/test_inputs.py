"""Input checks that must come early and mean what they say: every token id checked at load (the
held-out tail too, in the file's own dtype), the final state saved before the final evaluation,
config.toml reruns from any directory, resume refused only for flags that change the computation,
the NaN guard's pending steps bounded and the processes' inputs agreed (a fake coordination service
here; real processes in tests/test_agreement.py)."""

import json

import numpy as np
import pytest

from helpers import records, saved, step_records
from jaxdp import train as train_module
from jaxdp.checkpoint.resume import resume_fields
from jaxdp.cluster import agreement
from jaxdp.config import parse_args
from jaxdp.data.datasets import Dataset, load_dataset
from jaxdp.data.tokens import TokenDataset, load_tokens
from jaxdp.errors import InputError
from jaxdp.train import main, train

TINY_GPT = ["--model", "gpt", "--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16",
            "--batch-size", "8", "--no-progress", "--devices", "2"]


# ---- token ids ---------------------------------------------------------------------------------


def test_a_bad_token_id_in_the_held_out_split_exits_2_before_any_step(tmp_path, capsys):
    """It used to surface at the final evaluation: every step trained, exit 2, nothing saved."""
    ids = np.arange(20_000, dtype=np.int64) % 50
    ids[18_100] = 77  # in the held-out 10 % (from 18,000), inside its windows
    np.save(tmp_path / "t.npy", ids)
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    code = main([*TINY_GPT, "--dataset", str(tmp_path / "t.npy"), "--vocab-size", "50", "--steps", "3",
                 "--metrics-file", str(metrics), "--checkpoint-dir", str(ckpt)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert not metrics.exists() or not step_records(metrics)  # no step trained
    assert "holds token id 77 at position 18100 (held-out split), outside the vocabulary of 50" in err[0]


def test_int64_ids_past_2_to_the_32_are_out_of_range_not_wrapped(tmp_path):
    """2**32 + 5 cast to int32 first is 5, a valid id: silently wrong training."""
    ids = np.arange(5_000, dtype=np.int64) % 50
    ids[100] = 2**32 + 5
    np.save(tmp_path / "t.npy", ids)
    with pytest.raises(InputError, match=r"holds token id 4294967301 at position 100 \(training split\)"):
        load_tokens(str(tmp_path / "t.npy"), 16, 50)
    # The batch check (a file changed under a running job) compares before the cast too.
    dataset = TokenDataset(str(tmp_path / "t.npy"), np.load(tmp_path / "t.npy", mmap_mode="r"), 50, 16, 4_500)
    with pytest.raises(InputError, match="holds token id 4294967301"):
        dataset._windows(np.array([96]))


def test_the_whole_file_is_checked_in_chunks(tmp_path, monkeypatch):
    import jaxdp.data.tokens

    monkeypatch.setattr(jaxdp.data.tokens, "SCAN_CHUNK", 1000, raising=False)  # many chunks: the bad id is in the last one
    ids = np.arange(10_000, dtype=np.uint16) % 300
    ids[9_999] = 300
    ids.tofile(tmp_path / "t.bin")
    with pytest.raises(InputError, match="holds token id 300 at position 9999"):
        load_tokens(str(tmp_path / "t.bin"), 16, 300)
    ids[9_999] = 299
    ids.tofile(tmp_path / "t.bin")
    assert load_tokens(str(tmp_path / "t.bin"), 16, 300).vocab_size == 300


def test_the_final_state_is_saved_before_the_final_evaluation(tmp_path, monkeypatch, capsys):
    """Second line of defence: bad held-out input found at the end loses no training."""
    def bad_eval(self, *args, **kwargs):
        raise InputError("dataset file 'held-out' is bad", argument="dataset")

    monkeypatch.setattr(Dataset, "eval_batches", bad_eval)
    ckpt = tmp_path / "ckpt"
    assert main(["--steps", "4", "--no-progress", "--devices", "2", "--checkpoint-dir", str(ckpt)]) == 2
    assert "dataset file 'held-out' is bad" in capsys.readouterr().err
    assert saved(ckpt) == ["4"]


# ---- config.toml from another directory --------------------------------------------------------


def test_config_toml_reruns_from_another_directory(tmp_path, monkeypatch, capsys):
    """Relative paths in it used to name other files: a fresh run somewhere else, or exit 2."""
    first, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    first.mkdir(), elsewhere.mkdir()
    rng = np.random.default_rng(0)
    np.savez(first / "data.npz", x=rng.standard_normal((200, 5)), y=rng.integers(0, 3, 200))
    monkeypatch.chdir(first)
    flags = ["--dataset", "data.npz", "--checkpoint-dir", "ckpt", "--metrics-file", "m.jsonl", "--batch-size", "16",
             "--no-progress", "--devices", "2", "--log-every", "1"]
    assert main([*flags, "--steps", "3"]) == 0
    toml = (first / "ckpt" / "config.toml").read_text()
    assert f'dataset = "{first / "data.npz"}"' in toml and f'checkpoint-dir = "{first / "ckpt"}"' in toml
    capsys.readouterr()

    monkeypatch.chdir(elsewhere)
    assert main(["--config", str(first / "ckpt" / "config.toml"), "--steps", "5"]) == 0
    assert f"resumed from step 3 ({first / 'ckpt'})" in capsys.readouterr().err
    assert list(elsewhere.iterdir()) == []  # nothing written here
    assert [r["step"] for r in step_records(first / "m.jsonl")] == [1, 2, 3, 4, 5]


# ---- resume: refuse only what changes the computation ------------------------------------------


def test_resume_ignores_flags_that_cannot_matter():
    base = resume_fields(parse_args([]))  # adam, the MLP, synchronous training
    for argv in (["--prefetch", "0"], ["--momentum", "0.5"], ["--weight-decay", "0.3"], ["--layers", "7"],
                 ["--outer-lr", "0.1", "--outer-momentum", "0.5"], ["--attention", "xla"]):
        assert resume_fields(parse_args(argv)) == base, argv
    momentum = resume_fields(parse_args(["--optimizer", "momentum"]))
    assert resume_fields(parse_args(["--optimizer", "momentum", "--momentum", "0.5"])) != momentum
    for argv in (["--seed", "1"], ["--batch-size", "64"], ["--grad-accum", "2"], ["--precision", "bf16"]):
        assert resume_fields(parse_args(argv)) != base, argv


def test_a_run_resumes_with_another_prefetch_depth_and_an_unused_momentum(tmp_path):
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--no-progress", "--devices", "2"]
    assert main([*ckpt, "--steps", "2"]) == 0
    assert main([*ckpt, "--steps", "4", "--prefetch", "0", "--momentum", "0.5"]) == 0
    assert saved(tmp_path / "ckpt") == ["2", "4"]


# ---- the NaN guard's pending steps -------------------------------------------------------------


def test_a_large_log_every_keeps_at_most_max_pending_steps_unchecked(tmp_path, monkeypatch):
    """Every step's metrics waited on the devices until the next log point (+352 MB over 20,000
    steps); now at most MAX_PENDING_STEPS do, and every step is still checked, in order."""
    import jaxdp.metrics

    limit = train_module.MAX_PENDING_STEPS
    loop, lags, checked = [0], [], []
    real = jaxdp.metrics.check_finite

    def check_finite(step, metrics, *args):
        checked.append(step)
        lags.append(loop[0] - step)
        return real(step, metrics, *args)

    monkeypatch.setattr(jaxdp.metrics, "check_finite", check_finite)
    monkeypatch.setattr(jaxdp.metrics.MetricsWriter, "step", lambda self, n=1: loop.__setitem__(0, loop[0] + n))
    steps = 2 * limit + limit // 2
    result = train(parse_args(["--steps", str(steps), "--log-every", "100000", "--no-progress", "--devices", "2",
                               "--metrics-file", str(tmp_path / "m.jsonl")]))
    assert checked == list(range(1, steps + 1))
    assert max(lags) < limit, max(lags)
    assert [r["step"] for r in result.history] == [steps]  # the final step is still logged, once
    assert records(tmp_path / "m.jsonl")[-1]["event"] == "done"


# ---- agreement over the processes (a fake coordination service) --------------------------------


class _Store:
    """The calls the agreement makes of JAX's coordination-service client, in memory."""

    def __init__(self, **published):
        self.values = {f"jaxdp/inputs/{p[1:]}": json.dumps(record) for p, record in published.items()}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def digits():
    return load_dataset("digits")


def test_agreement_names_the_process_whose_input_is_bad():
    other = {"error": "dataset file 'data.npz' does not exist", "argument": "dataset", "setting": None}
    with pytest.raises(InputError) as err:
        agreement.load_dataset(digits, 0, 2, _Store(p1=other))
    assert str(err.value) == "on process 1 (of 2): dataset file 'data.npz' does not exist"
    assert err.value.argument == "dataset"


def test_agreement_stops_the_process_whose_input_is_bad_only_after_telling_the_others():
    store = _Store(p0={"fingerprint": digits().fingerprint()})

    def missing():
        raise InputError("dataset file 'data.npz' does not exist", argument="dataset")

    with pytest.raises(InputError, match=r"^on process 1 \(of 2\): dataset file 'data.npz' does not exist$"):
        agreement.load_dataset(missing, 1, 2, store)
    assert "error" in json.loads(store.values["jaxdp/inputs/1"])  # published: process 0 stops too


def test_agreement_names_processes_that_read_different_data():
    other = Dataset(*(a[:100] for a in (digits().x_train, digits().y_train)), digits().x_test, digits().y_test, 10)
    with pytest.raises(InputError) as err:
        agreement.load_dataset(digits, 0, 2, _Store(p1={"fingerprint": other.fingerprint()}))
    message = str(err.value)
    assert message.startswith("the processes read different data (process 0: 1438 training and 359 held-out rows")
    assert "process 1: 100 training and 359 held-out rows" in message and err.value.argument == "dataset"
    same_size = {"fingerprint": {**digits().fingerprint(), "digest": "0" * 32}}
    with pytest.raises(InputError, match="different contents"):
        agreement.load_dataset(digits, 0, 2, _Store(p1=same_size))
    assert agreement.load_dataset(digits, 0, 2, _Store(p1={"fingerprint": digits().fingerprint()})).num_classes == 10
