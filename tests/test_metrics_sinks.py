"""The MetricsWriter's progress bar and its Weights & Biases sink, and the files it writes whole, without a
training run."""

from __future__ import annotations

import glob
import json
import os
import re
import struct

import pytest

from jaxdp import metrics
from jaxdp.errors import InputError
from jaxdp.metrics import MetricsWriter


def run_writer(writer: MetricsWriter, start: int, total: int, log_every: int = 2) -> None:
    """What the training loop does with a writer, for steps start+1 .. total."""
    writer.event("start", start, resumed_from=start or None, config={"lr": 0.1, "steps": total}, devices=2)
    writer.first_step_done(start + 1)
    for step in range(start + 1, total + 1):
        if step > start + 1:
            writer.step()
        if step % log_every == 0 or step == total:
            writer.log(step, {"loss": 1.0 / step})
        if step == total - 1:
            writer.eval(step, {"eval_loss": 0.5})
    writer.done(total, {"eval_loss": 0.25, "strategy": "psum", "compile_s": None})
    writer.close()


def test_the_progress_bar_draws_its_final_line_once(capsys, monkeypatch):
    monkeypatch.setattr(metrics, "BAR_MININTERVAL", 0)  # every update draws: the worst case for a repeat
    run_writer(MetricsWriter(is_main=True, total_steps=12, progress=True), 0, 12)
    drawn = [line.strip() for line in re.split(r"[\r\n]", capsys.readouterr().err) if line.strip()]
    finals = [line for line in drawn if "12/12" in line]
    assert len(finals) == 1, drawn
    assert finals[0].startswith("100%") and "loss=0.0833" in finals[0]  # with the last logged loss
    assert drawn[-1] == finals[0] and any("11/12" in line for line in drawn)


def test_a_run_that_starts_at_its_last_step_draws_no_bar(capsys):
    run_writer(MetricsWriter(is_main=True, total_steps=1, progress=True), 0, 1)
    assert "1/1" not in capsys.readouterr().err


def wandb_records(path: str) -> list:
    """The records of an offline W&B run file (`run-ID.wandb`), read back with wandb's own protobuf
    schema. The file is a ":W&B" header (7 bytes), then LevelDB-log records in 32 KiB blocks: each a
    7-byte header (CRC, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes.

    `run.finish()` returns before wandb's service process has written the file out (it was empty
    in about 1 of 10 tries); `wandb.teardown()` stops the service, which writes everything first."""
    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    out, pos, parts, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def logged(records: list) -> dict[str, list]:
    """{key: [values in order]} of the history records, and the run ids, from `wandb_records`."""
    history: dict[str, list] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                history.setdefault(item.key or "/".join(item.nested_key), []).append(json.loads(item.value_json))
    return history


@pytest.mark.slow  # over 4 s on 2 cores
def test_wandb_gets_the_records_and_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    checkpoints = tmp_path / "ckpt"
    run_writer(MetricsWriter(is_main=True, total_steps=6, metrics_file=str(tmp_path / "m.jsonl"), progress=False,
                             wandb_project="jaxdp-test", wandb_id_dir=str(checkpoints)), 0, 6)
    run_id = (checkpoints / metrics.WANDB_ID_FILE).read_text().strip()
    (first,) = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
    records = wandb_records(first)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_id == run_id and run.project == "jaxdp-test"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["lr"] == 0.1 and config["run"]["devices"] == 2
    history = logged(records)
    assert history["train/loss"] == pytest.approx([1 / 2, 1 / 4, 1 / 6])  # as in the JSON Lines file
    assert history["step"] == [2, 4, 5, 6, 6] and history["eval/eval_loss"] == [0.5, 0.25]
    summary = {item.key: json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "summary"
               for item in r.summary.update}
    assert summary["eval_loss"] == 0.25 and summary["strategy"] == "psum"

    # Resumed from step 4 (start_step > 0): the same W&B run id, the steps after 4 logged again.
    run_writer(MetricsWriter(is_main=True, total_steps=8, start_step=4, progress=False, wandb_project="jaxdp-test",
                             wandb_id_dir=str(checkpoints)), 4, 8)
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(runs) == 2 and all(path.endswith(f"run-{run_id}.wandb") for path in runs)
    second = logged(wandb_records(next(path for path in runs if path != first)))
    assert second["train/loss"] == pytest.approx([1 / 6, 1 / 8])

    # A fresh run (start_step 0) in the same directory is a new W&B run.
    run_writer(MetricsWriter(is_main=True, total_steps=2, progress=False, wandb_project="jaxdp-test",
                             wandb_id_dir=str(checkpoints)), 0, 2)
    assert (checkpoints / metrics.WANDB_ID_FILE).read_text().strip() != run_id


def test_wandb_missing_is_one_line_saying_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(InputError, match=r"pip install 'jaxdp-trainer\[wandb\]'"):
        MetricsWriter(is_main=True, total_steps=2, progress=False, wandb_project="p")
    MetricsWriter(is_main=False, total_steps=2, progress=False, wandb_project="p")  # not process 0: not needed


def test_a_flag_whose_package_is_missing_is_refused_before_the_run(monkeypatch):
    import importlib.util

    from jaxdp.config import Config, ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tokenizers") else real(name, *a))
    with pytest.raises(ConfigError, match=r"--wandb-project needs the wandb package: pip install 'jaxdp-trainer\[wandb\]'"):
        Config(wandb_project="p")
    with pytest.raises(ConfigError, match=r"--tokenizer needs the tokenizers package: pip install 'jaxdp-trainer\[tokenizers\]'"):
        Config(model="gpt", dataset="book.txt", tokenizer="tok.json")


def test_ctrl_c_while_config_toml_is_written_leaves_no_temporary_file(tmp_path, monkeypatch):
    """The rename is where a Ctrl-C lands once the temporary file is whole: the old config.toml stays, and no
    config.toml.tmp-PID is left in the checkpoint directory."""
    path = tmp_path / "config.toml"
    path.write_text("steps = 2\n")

    def interrupted(source, target):
        assert os.path.exists(source)  # the temporary file was written
        raise KeyboardInterrupt

    monkeypatch.setattr(metrics.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        metrics.write_text_atomically(str(path), "steps = 4\n")
    assert sorted(os.listdir(tmp_path)) == ["config.toml"] and path.read_text() == "steps = 2\n"
