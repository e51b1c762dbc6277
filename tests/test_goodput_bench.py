"""The goodput benchmark's own accounting (jaxdp/bench/goodput.py): where a kill's time went, and its
busy-loop load; no timing is asserted, only the arithmetic on given timestamps."""

from __future__ import annotations

from jaxdp.bench.goodput import BusyLoad, timeline


def test_timeline_splits_each_kill_into_detection_restart_and_heal():
    kills = [10.0, 20.0]
    lines = [(5.0, "jaxdp: step 100: live ranks [0, 1]\n"),
             (10.6, "jaxdp: step 180: live ranks [0]; left out [1] (lost, or stalled past --stall-timeout)\n"),
             (10.2, "jaxdp.launch: worker 1 was killed by SIGKILL; restarting it alone (1 of 1000), the others train on\n"),
             (13.0, "jaxdp: rank 1 healed from step 0 to 230 with a live worker's state\n"),
             (20.4, "jaxdp: step 400: live ranks [1]; left out [0] (lost, or stalled past --stall-timeout)\n"),
             (20.1, "jaxdp.launch: worker 0 was killed by SIGKILL; restarting it alone (2 of 1000), the others train on\n"),
             (24.0, "jaxdp: rank 0 joined the run at step 460 with a live worker's state (no checkpoint read)\n"),
             (27.0, "jaxdp: step 600: live ranks [0]; left out [1] (lost, or stalled past --stall-timeout)\n")]
    lines.sort()
    figures = timeline(kills, lines)
    assert abs(figures["detect_s"] - (0.6 + 0.4) / 2) < 1e-9  # the median of 0.6 and 0.4
    assert abs(figures["restart_s"] - (0.2 + 0.1) / 2) < 1e-9
    assert abs(figures["back_s"] - (3.0 + 4.0) / 2) < 1e-9
    assert figures["left_out"] == 3  # one more than the kills: a live worker was left out once


def test_timeline_without_lines_says_none():
    assert timeline([10.0], []) == {"left_out": 0, "detect_s": None, "restart_s": None, "back_s": None}


def test_busy_load_starts_and_ends_its_processes():
    with BusyLoad(2) as load:
        assert len(load.procs) == 2 and all(p.poll() is None for p in load.procs)  # spinning
    assert all(p.poll() is not None for p in load.procs)  # killed and reaped
