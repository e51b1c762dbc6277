"""`python -m jaxdp.bench` end to end on tiny sizes: the JSON fields, the plot, the table.

No timing assertions: speed is what the benchmark measures, not what the tests check.
"""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT, cli_env, commands, readme_blocks, run_cli
from jaxdp.registry import STRATEGIES


TINY_GPT = ["--layers", "2", "--d-model", "64", "--heads", "4", "--seq-len", "32", "--vocab-size", "128",
            "--batch-size", "4", "--steps", "2", "--repeats", "1"]


@pytest.mark.slow  # a bench subprocess: about 20 s on 2 cores
def test_gpt_reports_tokens_flops_and_mfu(tmp_path):
    out = tmp_path / "g.json"
    proc = run_cli("gpt", *TINY_GPT, "--devices", "2", "--peak-tflops", "0.5", "--json", str(out), module="jaxdp.bench")
    assert proc.returncode == 0, proc.stderr
    (r,) = json.loads(out.read_text())["results"]
    assert r["devices"] == 2 and r["dtype"] == "bfloat16" and r["tokens_per_s"] == pytest.approx(4 * 32 / r["step_s"])
    # The model-FLOPs count MFU uses agrees with XLA's count of the compiled step (which adds the
    # softmax, LayerNorms and the optimizer) to within a few tens of percent.
    assert 0.7 < r["model_tflops_per_step"] / r["xla_tflops_per_step"] <= 1.0
    assert r["mfu"] == pytest.approx(r["achieved_tflops"] / (0.5 * 2))


def test_mfu_needs_a_known_peak():
    from jaxdp.metrics import peak_tflops

    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4 and peak_tflops("NVIDIA H100 80GB HBM3", "float32") is None
    assert peak_tflops("cpu", "bfloat16") is None  # bench gpt then reports "mfu": null and asks for --peak-tflops


def test_gpt_batch_size_flags_write_one_list():
    from jaxdp.bench.__main__ import build_parser

    parser = build_parser()
    assert parser.parse_args(["gpt"]).batch_sizes == [16]
    assert parser.parse_args(["gpt", "--batch-size", "8"]).batch_sizes == [8]
    assert parser.parse_args(["gpt", "--batch-sizes", "16,32"]).batch_sizes == [16, 32]
    assert parser.parse_args(["gpt", "--batch-sizes", "16,32", "--batch-size", "4"]).batch_sizes == [4]  # later wins
    for bad in (["--batch-size", "16,32"], ["--batch-sizes", "16,0"], ["--batch-sizes", "16,"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["gpt", *bad])


# The benchmarks' PyTorch side (gpt --vs-torch, ddp) is tested only with this set to 1: the test extra
# installs torch (for transformers and the oracles), but torch.compile and torchrun cost minutes on 2 cores.
TORCH_BENCH = "JAXDP_TORCH_BENCH"

TINY_VS_TORCH = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16", "--vocab-size", "64",
                 "--batch-sizes", "2,4", "--steps", "1", "--repeats", "1", "--vs-torch"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # torch.compile (inductor) builds C++ on the CPU: minutes with a cold cache
def test_gpt_vs_torch_reports_both_sides_per_batch_size(tmp_path):
    pytest.importorskip("torch", reason="needs torch: the test extra (pip install -e '.[test]'); test-core leaves it out")
    if os.environ.get(TORCH_BENCH) != "1":  # torch.compile builds C++ for minutes: past the suite's budget on 2 cores
        pytest.skip(f"the PyTorch side of the benchmarks runs with {TORCH_BENCH}=1 (torch.compile: minutes on 2 cores)")
    out = tmp_path / "g.json"
    proc = run_cli("gpt", *TINY_VS_TORCH, "--peak-tflops", "0.5", "--json", str(out), module="jaxdp.bench", timeout=540)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    rows = {(r["impl"], r["global_batch"]): r for r in report["results"]}
    assert set(rows) == {(impl, b) for impl in ("jaxdp", "torch") for b in (2, 4)}
    assert report["torch"] and report["machine"]["jax"]
    for b in (2, 4):
        jaxdp, torch = rows[("jaxdp", b)], rows[("torch", b)]
        assert jaxdp["params"] == torch["params"] > 0  # the same model, layer for layer
        assert jaxdp["model_tflops_per_step"] == torch["model_tflops_per_step"]  # the same FLOP formula
        assert jaxdp["vs_torch"] > 0 and torch["vs_torch"] is None
        assert isinstance(torch["compiled"], bool) and (torch["compiled"] or torch["note"])
        for r in (jaxdp, torch):
            assert r["tokens_per_s"] == pytest.approx(b * 16 / r["step_s"])
            assert r["mfu"] == pytest.approx(r["achieved_tflops"] / 0.5)
    table_rows = re.findall(r"^(jaxdp|torch) +(\d+) ", proc.stdout, re.M)  # one per (impl, batch size)
    assert "x torch" in proc.stdout and sorted((impl, int(b)) for impl, b in table_rows) == sorted(rows)


def test_gpt_vs_torch_without_torch_says_how_to_install_it(tmp_path):
    (tmp_path / "torch.py").write_text("raise ImportError('No module named torch')\n")  # shadows a real torch
    proc = run_cli("gpt", "--vs-torch", module="jaxdp.bench", env=cli_env(PYTHONPATH=str(tmp_path)))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "pip install -e '.[bench]'" in proc.stderr


def test_ddp_without_torch_says_how_to_install_it(tmp_path):
    (tmp_path / "torch.py").write_text("raise ImportError('No module named torch')\n")  # shadows a real torch
    proc = run_cli("ddp", module="jaxdp.bench", env=cli_env(PYTHONPATH=str(tmp_path)))
    assert proc.returncode == 2 and "pip install -e '.[bench]'" in proc.stderr


# The README's "Performance" commands, shrunk to seconds (later flags win in argparse); results go
# to tmp_path, not over the committed docs/perf files.
SHRINK = {"collectives": ["--sizes", "1KB,64KB", "--repeats", "1"],
          "train": ["--devices", "1,2", "--steps", "2", "--repeats", "1", "--batch-size", "16"],
          "ddp": ["--rounds", "1", "--steps", "2", "--repeats", "1", "--batch-size", "16"]}


@pytest.mark.slow
def test_readme_performance_commands(tmp_path):
    shown = [c for b in readme_blocks("tests/test_bench.py::test_readme_performance_commands") for c in commands(b)]
    bench = [shlex.split(c) for c in shown if c.startswith("python -m jaxdp.bench ")]
    assert bench and len(bench) == len(shown), shown
    assert sorted(argv[3] for argv in bench) == sorted(SHRINK)
    for argv in bench:
        command = argv[3]
        if command == "ddp" and (importlib.util.find_spec("torch") is None or os.environ.get(TORCH_BENCH) != "1"):
            continue  # PyTorch DDP under torchrun: with JAXDP_TORCH_BENCH=1 (and torch) only
        out = ["--json", str(tmp_path / f"{command}.json")] + (["--plot", str(tmp_path / "c.png")] if "--plot" in argv else [])
        proc = run_cli(*argv[3:], *SHRINK[command], *out, module="jaxdp.bench")
        assert proc.returncode == 0, f"{' '.join(argv)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        CHECKS[command](json.loads((tmp_path / f"{command}.json").read_text())["results"], proc.stdout, tmp_path)


def check_collectives(results, stdout, tmp_path):
    assert {(r["strategy"], r["bytes"]) for r in results} >= {(s, b) for s in STRATEGIES for b in (1024, 65536)}
    for r in results:
        n = r["devices"]
        assert r["median_s"] > 0 and r["algbw_gbps"] == pytest.approx(r["bytes"] / r["median_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (n - 1) / n)
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "busbw" in stdout and all(name in stdout for name in STRATEGIES)


def check_train(results, stdout, tmp_path):
    cases = {(r["impl"], r["strategy"], r["devices"]) for r in results}
    assert ("jit", "-", 1) in cases and ("shard_map+pmean", "-", 2) in cases
    assert {(s, n) for s in STRATEGIES for n in (1, 2)} <= {(r["strategy"], r["devices"]) for r in results if r["impl"] == "jaxdp"}
    for r in results:
        assert r["steps_per_s"] > 0 and r["examples_per_s"] == pytest.approx(16 * r["steps_per_s"])
        assert r["vs_shard_map"] > 0


def check_ddp(results, stdout, tmp_path):
    by_impl = {(r["impl"], r["strategy"]): r for r in results}
    assert {("pytorch-ddp", "gloo"), ("jaxdp", "psum"), ("jaxdp", "ring")} <= set(by_impl)
    assert by_impl[("pytorch-ddp", "gloo")]["vs_ddp"] == 1.0


CHECKS = {"collectives": check_collectives, "train": check_train, "ddp": check_ddp}


@pytest.mark.slow  # over 4 s on 2 cores
def test_cli_reexecs_itself_once_with_the_malloc_env(tmp_path):
    from jaxdp.cluster.malloc_env import MALLOC_ENV

    base = {k: v for k, v in cli_env().items() if k not in MALLOC_ENV and k != "JAXDP_MALLOC_ENV"}
    for opt_out, expected in (({}, MALLOC_ENV), ({"JAXDP_MALLOC_ENV": "0"}, dict.fromkeys(MALLOC_ENV))):
        out = tmp_path / "m.json"
        proc = run_cli("collectives", "--devices", "1", "--sizes", "1KB", "--repeats", "1", "--json", str(out),
                       module="jaxdp.bench", env={**base, **opt_out})
        assert proc.returncode == 0, proc.stderr
        assert json.loads(out.read_text())["machine"]["malloc_env"] == expected
    # Exit codes pass through: the re-exec'd process is the process (os.execve, same PID).
    proc = run_cli("--bogus", env=base)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unrecognized arguments" in proc.stderr


def test_workers_are_hidden_from_help_but_parse():
    from jaxdp.bench import ddp
    from jaxdp.bench.__main__ import build_parser

    parser = build_parser()
    assert "worker" not in parser.format_help()
    args = parser.parse_args(["train-worker", "--port", "1234", "--rank", "1", "--strategies", "psum"])
    assert args.run is ddp.run_train_worker and args.strategies == ["psum"] and args.pin
    assert parser.parse_args(["ddp-worker", "--port", "1234", "--rank", "0", "--no-pin"]).run is ddp.run_ddp_worker


def test_train_worker_passes_options_and_leaves_its_args_alone(monkeypatch):
    from jaxdp.bench import ddp, train
    from jaxdp.bench.__main__ import build_parser

    seen = []
    monkeypatch.setattr(train, "run", lambda options: seen.append(options) or [])
    args = build_parser().parse_args(["train-worker", "--port", "1234", "--rank", "1", "--no-pin", "--steps", "3"])
    before = vars(args).copy()
    assert ddp.run_train_worker(args) == []
    assert vars(args) == before
    (options,) = seen
    assert options == train.Options(devices=(1,), steps=3, repeats=7, batch_size=256, strategies=None, json=None,
                                    coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1)


def test_parser_and_benchmark_modules_import_no_jax():
    # __main__ re-execs the process (malloc_env) before anything loads JAX: only `run` may import it.
    code = ("import sys; from jaxdp.bench.__main__ import build_parser; build_parser(); "
            "sys.exit(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'torch')) or 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=cli_env())
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow  # over 4 s on 2 cores
def test_plan_predicts_and_says_what_auto_would_choose(tmp_path):
    out = tmp_path / "p.json"
    proc = run_cli("plan", "--nodes", "2", "--link", "10mbit", "--compute-ms", "15", "--json", str(out),
                   module="jaxdp.bench")
    assert proc.returncode == 0, proc.stderr
    assert "--sync-every auto --compression auto:" in proc.stdout and "--overlap:" in proc.stdout
    written = json.loads(out.read_text())
    assert written["compute_s"] == 0.015 and written["cluster"]["nodes"] == 2
    plain, hidden = written["auto"]
    # 10 Mbit/s against 15 ms of compute: the MLP's top-k fits at every step (the guard then checks it)
    assert plain["sync_every"] == 1 and plain["compression"].startswith("topk:") and "quality guard" in plain["summary"]
    assert hidden["compression"] == plain["compression"] and not hidden["overlap"]
    # 1 Mbit/s against 1 ms: nothing fits at every step; local steps with a top-k pseudo-gradient (with
    # SparseLoCo's outer settings, which the plan names; with DiLoCo's outer momentum, a quantized one);
    # overlapped, fewer steps
    slow = run_cli("plan", "--nodes", "2", "--link", "1mbit", "--compute-ms", "1", "--json", str(out), module="jaxdp.bench")
    assert slow.returncode == 0, slow.stderr
    plain, hidden = json.loads(out.read_text())["auto"]
    assert plain["sync_every"] > 1 and plain["compression"].startswith("topk:") and ":2:gather:decay=" in plain["compression"]
    assert "--outer-momentum 0" in plain["summary"] and re.search(r"Nesterov\): --sync-every \d+, pseudo-gradient int[48]",
                                                                   plain["summary"])
    assert hidden["overlap"] and hidden["sync_every"] <= plain["sync_every"]
    # it says why, and why it did not take the faster rows it printed above its choice
    assert "local steps, averaged every" in plain["summary"]
    assert "row(s) above are faster: auto does not take the fastest row but the fewest local steps" in slow.stdout
    rows = written["results"]
    assert rows == sorted(rows, key=lambda r: r["step_s"]) and {r["hierarchy"] for r in rows} == {"flat"}
    bad = run_cli("plan", "--link", "fast", "--compute-ms", "1", module="jaxdp.bench")
    assert bad.returncode != 0 and "is not a bandwidth" in bad.stderr and "Traceback" not in bad.stderr


def test_the_testbed_prediction_with_and_without_its_token_bucket():
    from jaxdp.bench.plan import testbed_step_s

    rate, burst = 1e8, 125_000  # 100 Mbit/s: 12.5 MB/s, a 10 ms bucket
    # 100 kB after 4 ms of compute: the bucket refilled 50 kB, the other 50 kB wait 4 ms
    assert testbed_step_s(0.004, 100_000, 1, rate, burst) == pytest.approx(0.008)
    assert testbed_step_s(0.004, 100_000, 1, rate, burst, bucket=False) == pytest.approx(0.012)  # the cost model's rule
    # H = 8: over a round the bucket refills to its burst; what is left waits, shared by 8 steps
    assert testbed_step_s(0.004, 340_000, 8, rate, burst) == pytest.approx(0.004 + (340_000 - burst) * 8 / rate / 8)
    # overlapped: the longer of the compute and the link's share
    assert testbed_step_s(0.004, 340_000, 8, rate, burst, overlap=True) == pytest.approx(0.004)
    assert testbed_step_s(0.001, 340_000, 8, rate, burst, overlap=True) == pytest.approx(340_000 * 8 / rate / 8)


@pytest.mark.parametrize("flags, words", [
    (["--compute-ms", "-1"], "--compute-ms must be a finite number above 0 (one device's milliseconds per step), got -1"),
    (["--compute-ms", "0"], "--compute-ms must be a finite number above 0"),
    (["--compute-ms", "nan"], "--compute-ms must be a finite number above 0"),
    (["--compute-ms", "inf"], "--compute-ms must be a finite number above 0"),
    (["--compute-ms", "15", "--comm-target", "nan"], "--comm-target must be a finite number above 0"),
    (["--compute-ms", "15", "--comm-target", "0"], "--comm-target must be a finite number above 0"),
    (["--compute-ms", "15", "--comm-target", "-1"], "--comm-target must be a finite number above 0"),
    (["--compute-ms", "15", "--top", "0"], "--top must be 1 or more (rows to print), got 0"),
    (["--compute-ms", "15", "--top", "-3"], "--top must be 1 or more"),
    (["--compute-ms", "15", "--train-args", "--model 'gpt"], "--train-args \"--model 'gpt\" does not split as a shell"),
])
def test_plan_refuses_nonsense_numbers_in_one_line(capsys, flags, words):
    """Each was a traceback (StopIteration, ValueError, TypeError) or a nonsense plan ("126x", "nanx")."""
    from jaxdp.bench.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--nodes", "2", "--link", "10mbit", *flags])
    said = capsys.readouterr()
    assert exit_.value.code == 2 and said.out == "", said
    assert said.err == f"jaxdp.bench plan: error: {said.err.split('error: ', 1)[1]}" and said.err.count("\n") == 1
    assert words in said.err, said.err


def test_collectives_reduce_scatter_times_three_ways(tmp_path):
    """--reduce-scatter: XLA's psum_scatter, psum + slice and the ring's, per size (one process here;
    docs/performance.md runs it under jaxdp.launch)."""
    out = tmp_path / "rs.json"
    proc = run_cli("collectives", "--reduce-scatter", "--devices", "2", "--sizes", "1KB,64KB", "--repeats", "1",
                   "--json", str(out), module="jaxdp.bench")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["way"], r["size"], r["chunk"]) for r in rows] == [(way, size, chunk) for size, chunk in
                                                               (("1KB", "512B"), ("64KB", "32KB"))
                                                               for way in ("psum_scatter", "psum+slice", "ring")]
    assert all(r["processes"] == 1 and r["devices"] == 2 for r in rows)
    assert [r["vs_psum_scatter"] for r in rows if r["way"] == "psum_scatter"] == [1.0, 1.0]
    assert "x psum_scatter time" in proc.stdout


@pytest.mark.slow  # a tiny GPT compiled without the cache: about 30 s on 2 cores
def test_data_tokenizes_a_jsonl_corpus_and_reports_peak_memory(tmp_path):
    from jaxdp.bench.__main__ import main

    out = tmp_path / "d.json"
    assert main(["data", "--size", "1MB", "--files", "2", "--steps", "1", "--keep", str(tmp_path / "corpus"),
                 "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    written = sum(p.stat().st_size for p in (tmp_path / "corpus").iterdir())
    assert r["jsonl_bytes"] == written >= 1 << 20 and written / 2 < r["tokens"] < written  # (JSON escapes, the source key)
    assert 0 < r["tokenizing_rssanon"] <= r["tokenizing_vmrss"] and r["training_vmrss"] > 0
    assert sorted(p.name for p in (tmp_path / "corpus").iterdir()) == ["part-000.jsonl", "part-001.jsonl"]


@pytest.mark.slow  # a subprocess that compiles two codecs: about 10 s on 2 cores
def test_gpu_tools_times_the_codecs_and_each_changes_the_gradient_by_its_own_rounding(tmp_path):
    """docs/perf/gpu_tools.py codecs (run on a lent GPU) on a tiny GPT on the CPU: int4's one hop
    changes the gradient more than int8's, and neither by more than its blocks' scale allows."""
    out = tmp_path / "codecs.json"
    proc = subprocess.run([sys.executable, "docs/perf/gpu_tools.py", "codecs", "int8;int4", "--repeats", "2", "--json",
                           str(out)], cwd=ROOT, env=cli_env(GPU_SMALL="1", PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    int8, int4 = result["codecs"]["int8"], result["codecs"]["int4"]
    assert result["values"] == 170240 and int8["ms"] > 0 and int4["ms"] > 0
    # The gradient is 1e-3 x N(0, 1): a block's largest value is under 6e-3, so int8's rounding is
    # under 6e-3 / 127 and int4's under 6e-3 / 7 (each half a step, at most).
    assert 0 < int8["max_abs_change"] < 6e-3 / 127 < int4["max_abs_change"] < 6e-3 / 7
    assert int4["bytes"] < int8["bytes"]


def test_variants_says_what_auto_chose():
    """`bench variants` reports what --compression auto / --sync-every auto chose, from the run's own
    records: each choice once, in order; a compression plan that local steps replaced is not one."""
    from jaxdp.bench.variants import chosen

    assert chosen([{"step": 2, "loss": 1.0}, {"event": "done"}]) is None
    assert chosen([{"event": "compression", "choice": "int4"}, {"step": 1},
                   {"event": "compression", "choice": "topk:0.001:gather"}, {"event": "compression", "choice": "int4"}]) \
        == "int4; topk:0.001:gather"
    assert chosen([{"event": "compression", "choice": "powersgd:1", "applied": False},
                   {"event": "local_steps", "sync_every": 16, "pseudo_gradient": "int4"}]) == "--sync-every 16, int4"
    assert chosen([{"event": "local_steps", "sync_every": 1}]) == "--sync-every 1"


def test_goodput_counts_the_worker_steps_an_elastic_run_of_local_steps_missed():
    from jaxdp.bench.goodput import _rounds, missed_steps

    said = ("jaxdp: step 44: live ranks [0]; left out [1] (lost, or stalled past --stall-timeout)\n"
            "jaxdp: other lines\n"
            "jaxdp: step 48: live ranks [1]; left out [0]; back [1]\n"
            "jaxdp: step 56: live ranks [0, 1]; back [0]\n"
            "jaxdp: step 796: live ranks [0]; left out [1]\n")
    assert missed_steps(said, 800, 2) == 4 + 8 + 4  # rank 1 for 44..48, rank 0 for 48..56, rank 1 for 796..800
    assert missed_steps("", 800, 2) == 0
    assert _rounds("--strategy psum --sync-every 8") and _rounds("--sync-every=4")
    assert not _rounds("--sync-every 1") and not _rounds("--strategy psum")


def test_goodput_summarises_its_pairs_by_their_medians():
    from jaxdp.bench.goodput import median_row

    pairs = [{"mode": "elastic (torchft)", "steps": 10, "save_every": "100", "kill_every_s": 10.0, "undisturbed_s": u,
              "disturbed_s": d, "kills": k, "goodput": u / d, "lost_per_kill_s": (d - u) / k, "same_final_params": same}
             for u, d, k, same in ((100.0, 110.0, 10, True), (90.0, 120.0, 12, True), (110.0, 115.0, 11, True))]
    row = median_row(pairs)
    assert row["repeat"] == "median" and row["same_final_params"]
    assert row["goodput"] == 100 / 110  # the median of the pairs' ratios, not 100 / 115 (the ratio of the medians)
    assert row["undisturbed_s"] == 100.0 and row["disturbed_s"] == 115.0 and row["kills"] == 11
    assert "examples_done" not in row
    pairs[1]["same_final_params"] = False
    assert not median_row(pairs)["same_final_params"]


@pytest.mark.slow  # three tiny jaxdp.train runs: about 30 s on 2 cores
def test_quality_writes_steps_and_seconds_to_the_target_per_variant(tmp_path):
    text = tmp_path / "text.txt"
    text.write_bytes(b"def f(x):\n    return x + 1\n" * 400)
    out = tmp_path / "q.json"
    proc = run_cli("quality", "--dataset", str(text), "--steps", "6", "--eval-every", "3", "--eval-batches", "1",
                   "--seeds", "0", "--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16",
                   "--batch-size", "4", "--sync-every", "2", "--json", str(out), module="jaxdp.bench")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [r["variant"] for r in report["runs"]] == ["adamw", "muon", "nesterov"]
    adamw = report["runs"][0]
    assert report["target"] == adamw["final"] == adamw["held_out"]["6"]  # auto: the worst (here only) adamw final
    assert adamw["steps_to_target"] in (3, 6) and set(adamw["held_out"]) == {"3", "6"}
    assert all(set(r) >= {"held_out", "elapsed_s", "final", "steps_to_target", "seconds_to_target", "steps_per_s"}
               for r in report["runs"])
    assert [s["variant"] for s in report["summary"]] == ["adamw", "muon", "nesterov"] and report["summary"][0]["reached"] == 1
