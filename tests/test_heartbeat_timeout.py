"""The torchft Lighthouse's heartbeat timeout, derived from the wake-up lateness the launcher measures
(jaxdp/launcher/ft.py): the derivation on given lateness, no timing asserted."""

from __future__ import annotations

from jaxdp.launcher import ft


def test_a_quiet_machine_keeps_the_defaults():
    quiet = [0.0001] * 20
    assert ft.derived_timeout(1, quiet) == ft.HEARTBEAT_TIMEOUT_S["one node"] == 0.5
    assert ft.derived_timeout(2, quiet) == ft.HEARTBEAT_TIMEOUT_S["several nodes"] == 1.0
    assert ft.derived_timeout(1, []) == 0.5


def test_a_busy_machine_adds_late_beats_of_the_90th_percentile():
    lateness = [0.001] * 17 + [0.03, 0.03, 0.5]  # the 90th percentile is 30 ms; one outlier does not count
    assert ft.derived_timeout(1, lateness) == round(0.5 + ft.LATE_BEATS * 0.03, 1) == 0.8
    assert ft.derived_timeout(2, lateness) == 1.3


def test_the_timeout_is_capped():
    assert ft.derived_timeout(1, [2.0] * 20) == ft.MAX_TIMEOUT_S


def test_the_launcher_says_when_it_raises_the_timeout(capsys):
    assert ft.heartbeat_timeout(1, [0.05] * 20) == 1.0
    assert "heartbeat timeout 1 s, not 0.5" in capsys.readouterr().err
    assert ft.heartbeat_timeout(1, [0.0] * 20) == 0.5
    assert capsys.readouterr().err == ""
