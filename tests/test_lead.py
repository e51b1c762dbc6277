"""The lead of an elastic run on torchft moves (jaxdp/loop/lead.py): the rule every worker applies to the
same rows (jaxdp/elastic/every_step.py, `lead_of`), the metrics writer that takes over and hands over
(jaxdp/metrics.py), and the loop's hook that opens and closes the checkpointer, waiting while a former
lead still holds the directory's lock. (Real workers, a real Lighthouse and a killed rank 0:
tests/test_elastic_ft.py.)"""

import json
import types

import pytest

from jaxdp.checkpoint.dirlock import DirectoryInUse, DirectoryLock
from jaxdp.loop import lead
from jaxdp.loop.options import CheckpointOptions
from jaxdp.loop.resolve import Plan
from jaxdp.metrics import MetricsWriter
from jaxdp.elastic.every_step import LEADS, TAKES_PART, lead_of


def row(rank: int | None, *flags: int) -> tuple[int, int]:
    """A row's (tag, flags): rank + 1 (None: a worker that sits the step out)."""
    return (0 if rank is None else rank + 1), sum(flags)


def test_the_lead_stays_while_it_lives_and_moves_to_the_lowest_live_rank_when_it_does_not():
    assert lead_of([row(0, TAKES_PART, LEADS), row(1, TAKES_PART)], 0) == 0  # the start
    assert lead_of([row(1, TAKES_PART)], 0) == 1  # rank 0 lost: the lowest live rank
    assert lead_of([row(None), row(1, TAKES_PART, LEADS)], 1) == 1  # rank 0 back, healing: rank 1 keeps it
    assert lead_of([row(0, TAKES_PART), row(1, TAKES_PART, LEADS)], 1) == 1  # rank 0 back: still rank 1
    assert lead_of([row(1, TAKES_PART), row(2, TAKES_PART), row(3, TAKES_PART, LEADS)], 3) == 3
    assert lead_of([row(1, TAKES_PART), row(2, TAKES_PART)], 3) == 1  # the lead (3) lost
    assert lead_of([(-3, TAKES_PART | LEADS), row(0, TAKES_PART)], 2) == 2  # its sums not finite: it still leads
    assert lead_of([row(None), row(None)], 1) == 1  # nobody took part: as it was
    # a LEADS flag counts only from a worker that takes part (one that heals has led no step of these)
    assert lead_of([row(None, LEADS), row(2, TAKES_PART)], 0) == 2
    # two rows that say so (a restarted rank 0 that took the directory's lock while the lead waited
    # for it): the lower rank, the one holding the lock
    assert lead_of([row(0, TAKES_PART, LEADS), row(1, TAKES_PART, LEADS)], None) == 0


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_metrics_writer_takes_over_the_file_from_its_step_and_hands_it_over(tmp_path):
    path = tmp_path / "m.jsonl"
    lead0 = MetricsWriter(is_main=True, total_steps=10, metrics_file=str(path), progress=False)
    lead0.event("start", 0)
    stand_in = MetricsWriter(is_main=False, total_steps=10, metrics_file=str(path), progress=False)
    history = []
    for step in (1, 2, 3):
        history.append(stand_in.log(step, {"loss": 1.0 / step}))  # a follower's records: kept, not written
        if step < 3:
            lead0.log(step, {"loss": 1.0 / step})
    assert [r.get("event", r["step"]) for r in records(path)] == ["start", 1, 2]
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')  # the former lead killed while it wrote step 3
    stand_in.take_over(4, history)  # it leads from step 4: step 3 from its own records, the torn line dropped
    stand_in.event("lead", 4, rank=1)
    stand_in.log(4, {"loss": 0.25})
    assert [r.get("event", r["step"]) for r in records(path)] == ["start", 1, 2, 3, "lead", 4]
    assert records(path)[3]["loss"] == 1.0 / 3 and records(path)[-1]["loss"] == 0.25
    stand_in.hand_over()
    stand_in.log(5, {"loss": 0.2})
    assert len(records(path)) == 6 and not stand_in.is_main


def test_a_round_without_steps_that_the_former_lead_did_not_write_is_written_by_the_new_one(tmp_path):
    """Rounds: a round in which nobody took a step (a joiner listened, and the lead was lost in it) ends
    at the step of the round before; the new lead writes it from its own records all the same."""
    path = tmp_path / "m.jsonl"
    lead0 = MetricsWriter(is_main=True, total_steps=1000, metrics_file=str(path), progress=False)
    stand_in = MetricsWriter(is_main=False, total_steps=1000, metrics_file=str(path), progress=False)
    history = []
    for round_, step in ((4, 288), (5, 372), (6, 372), (7, 394)):
        history.append(stand_in.log(step, {"loss": 1.0, "round": round_}))
        if round_ <= 5:  # the former lead lost before it wrote round 6
            lead0.log(step, {"loss": 1.0, "round": round_})
    stand_in.take_over(394, history)
    assert [(r["step"], r["round"]) for r in records(path)] == [(288, 4), (372, 5), (372, 6), (394, 7)]


def test_a_worker_the_run_went_on_without_steps_aside_instead_of_leading(tmp_path, capsys):
    """A worker about to lead whose step (40) is behind the run's files (a stopped worker, back after the
    others trained on): no record, no checkpointer; exit 0 where the run reached its end, else 75."""
    (tmp_path / "ckpt").mkdir()
    lead0 = MetricsWriter(is_main=True, total_steps=100, metrics_file=str(tmp_path / "m.jsonl"), progress=False)
    lead0.log(60, {"loss": 1.0})
    before = (tmp_path / "m.jsonl").read_text()
    member = Member(1, lead=True)
    loop = loop_of(tmp_path, member)
    with pytest.raises(SystemExit) as stopped:
        lead.follow(loop)
    assert stopped.value.code == 75 and not loop.plan.is_main and loop.plan.checkpointer is None
    assert "rank 1: the run went on to step 60 without this worker, which was left out at step 40" in \
        capsys.readouterr().err
    assert (tmp_path / "m.jsonl").read_text() == before
    lead0.event("done", 100)
    with pytest.raises(SystemExit) as stopped:
        lead.follow(loop)
    assert stopped.value.code == 0
    loop.done = 100  # (a worker at the run's step leads as ever)
    lead.follow(loop)
    assert loop.plan.is_main
    loop.plan.checkpointer.close()


class Member:
    """What the hook reads of an elastic member: its rank, whether it leads, and an engine (the mark of a
    run whose lead can move)."""

    def __init__(self, rank: int, lead: bool):
        self.rank, self.lead, self.engine = rank, lead, object()


def loop_of(tmp_path, member: Member) -> types.SimpleNamespace:
    plan = Plan(mesh=None, steps=100, is_main=False, n_processes=2, devices=2, started=0.0, beat=None, data=None,
                batch_at=None, cache_hits=None, elastic=member)
    plan.checkpoint = CheckpointOptions(directory=str(tmp_path / "ckpt"), save_every=10)
    writer = MetricsWriter(is_main=False, total_steps=100, metrics_file=str(tmp_path / "m.jsonl"), progress=False)
    return types.SimpleNamespace(plan=plan, writer=writer, done=40, history=[])


def test_a_new_lead_opens_the_checkpointer_waits_while_the_former_lead_holds_the_lock_and_hands_all_over(
        tmp_path, capsys, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    member = Member(1, lead=False)
    loop = loop_of(tmp_path, member)
    lead.follow(loop)
    assert loop.plan.checkpointer is None and not loop.plan.is_main  # a follower opens nothing
    former = DirectoryLock(str(tmp_path / "ckpt"))  # the former lead, stopped but alive: it holds the lock
    member.lead = True
    lead.follow(loop)
    assert loop.plan.is_main and loop.writer.is_main and loop.plan.checkpointer is None
    err = capsys.readouterr().err
    assert "jaxdp: rank 1 leads from step 40: it writes the metrics, saves the checkpoints and evaluates" in err, err
    assert "still locked by the former lead" in err, err
    lead.follow(loop)  # (within RETRY_S: no new try, no new line)
    assert "still locked" not in capsys.readouterr().err
    former.release()
    monkeypatch.setattr(lead, "RETRY_S", 0.0)
    loop.plan.lead_retry_at = 0.0  # (a second later)
    lead.follow(loop)
    assert loop.plan.checkpointer is not None and loop.plan.checkpointer.directory == str(tmp_path / "ckpt")
    with pytest.raises(DirectoryInUse):  # the new lead holds it now
        DirectoryLock(str(tmp_path / "ckpt"))
    assert [r["event"] for r in records(tmp_path / "m.jsonl")] == ["lead"]
    member.lead = False  # it healed from a peer (stopped, then on again): it leads no more
    lead.follow(loop)
    assert loop.plan.checkpointer is None and not loop.plan.is_main and not loop.writer.is_main
    DirectoryLock(str(tmp_path / "ckpt")).release()  # its lock is free for the next lead


def test_at_a_lost_quorum_one_worker_takes_the_lock_and_saves(tmp_path):
    (tmp_path / "ckpt").mkdir()
    first, second = loop_of(tmp_path, Member(1, lead=False)), loop_of(tmp_path, Member(2, lead=False))
    assert lead.claim(first)
    assert not lead.claim(second)  # the lock is taken: the other saves
    first.plan.checkpointer.close()


def test_a_worker_that_may_lead_later_has_orbax_loaded_before_it_takes_over():
    """`prepare` loads orbax and its handlers at the start: the checkpointer's module imports orbax on
    first use only, so a takeover that opened the first checkpointer would import it there while every
    worker waits. Checked in a fresh interpreter, where nothing else has imported orbax yet."""
    import subprocess
    import sys

    code = ("import sys; from jaxdp.loop import lead; import jaxdp.checkpoint.checkpointer; "
            "before = 'orbax.checkpoint' in sys.modules; lead.prepare(None); "
            "print(before, 'orbax.checkpoint' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]
