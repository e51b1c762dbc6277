"""`python -m jaxdp.bench` end to end on tiny sizes: the JSON fields, the plot, the table.

No timing assertions: speed is what the benchmark measures, not what the tests check.
"""

import json

import pytest

from conftest import cli_env, run_cli
from jaxdp.sync import STRATEGIES


def test_collectives_json_table_and_plot(tmp_path):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    proc = run_cli("collectives", "--devices", "4", "--sizes", "1KB,64KB", "--repeats", "3",
                   "--json", str(out), "--plot", str(png), module="jaxdp.bench")
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    assert {(r["strategy"], r["bytes"]) for r in results} == {(s, b) for s in STRATEGIES for b in (1024, 65536)}
    for r in results:
        assert r["devices"] == 4 and r["median_s"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["median_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * 3 / 4)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "busbw" in proc.stdout and all(name in proc.stdout for name in STRATEGIES)


def test_train_reports_jaxdp_and_both_baselines(tmp_path):
    out = tmp_path / "t.json"
    proc = run_cli("train", "--devices", "1,2", "--steps", "2", "--repeats", "1", "--batch-size", "16",
                   "--json", str(out), module="jaxdp.bench")
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())["results"]
    cases = {(r["impl"], r["strategy"], r["devices"]) for r in results}
    assert ("jit", "-", 1) in cases and ("shard_map+pmean", "-", 2) in cases
    assert {(s, n) for s in STRATEGIES for n in (1, 2)} <= {(r["strategy"], r["devices"]) for r in results if r["impl"] == "jaxdp"}
    for r in results:
        assert r["steps_per_s"] > 0 and r["examples_per_s"] == pytest.approx(16 * r["steps_per_s"])
        assert r["vs_shard_map"] > 0


def test_ddp_without_torch_says_how_to_install_it(tmp_path):
    (tmp_path / "torch.py").write_text("raise ImportError('No module named torch')\n")  # shadows a real torch
    proc = run_cli("ddp", module="jaxdp.bench", env=cli_env(PYTHONPATH=str(tmp_path)))
    assert proc.returncode == 2 and "pip install -e '.[bench]'" in proc.stderr


def test_ddp_comparison_runs_both_sides(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "d.json"
    proc = run_cli("ddp", "--rounds", "1", "--repeats", "1", "--steps", "2", "--batch-size", "16",
                   "--json", str(out), module="jaxdp.bench")
    assert proc.returncode == 0, proc.stderr
    results = {(r["impl"], r["strategy"]): r for r in json.loads(out.read_text())["results"]}
    assert {("pytorch-ddp", "gloo"), ("jaxdp", "psum"), ("jaxdp", "ring")} <= set(results)
    assert results[("pytorch-ddp", "gloo")]["vs_ddp"] == 1.0
