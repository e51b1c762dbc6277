"""`--compression auto` and `--sync-every auto`: choose compression and local steps from measured
compute and communication time.

    begun = start(requested_spec, mesh, params, make_state=..., make_step=..., batches=..., recorded=...)
                                                      # jaxdp/sync/autostart.py: at a run's start
    spec = begun.spec                                 # a SyncSpec: the codec and H to train with now
    decision = begun.controller.decide(state, batches, step)   # --compression auto, again while training
    spec = spec.replace(compression=decision.compressor)      # None (plain), Bf16 or PowerSGD(rank)

`Controller(local_grads, mesh, strategy, params)` measures; the decisions themselves are pure
functions of the measured figures (jaxdp/sync/costmodel.py).

Each decision measures, on the run's own devices and link:
* compute: the step's forward and backward pass on the device's slice of a real batch, with no
  collective (the fastest of a few runs: other work on the machine only ever adds time, and a
  busy machine made medians look bandwidth-bound where the link was not);
* communication: the strategy's all-reduce of a buffer as big as the gradients, and of one 1/16
  of that size; a line through the two (`costmodel.fit_comm_model`) gives latency and bandwidth.

Every process measures, and the slowest process's figures decide (gathered, so every process
takes the same decision). `costmodel.plan` then picks the least compression whose predicted
all-reduce time is at most `target` x compute: none on a fast link, bf16, on a ring int8 or int4
(within `costmodel.QUANT_BOUND`), PowerSGD at the largest rank that fits, or top-k at the
densest density that fits. A PowerSGD or top-k choice must pass the quality guard: over `GUARD_BATCHES`
batches at the current parameters, the sum of the compressed, error-corrected gradients against
the sum of the true mean gradients (one uncompressed all-reduce per batch: what the guard costs;
the candidates are then replayed on those means with no collective, `Controller.truth`),
`costmodel.relative_error`; above `costmodel.GUARD_THRESHOLD` the
controller steps back to the next weaker candidate (a denser top-k, PowerSGD's higher ranks, then
int4 or bf16 ...) and checks again; a decision's "fits" is its final choice's.

Every decision is a record of the metrics file ("event": "compression") with the numbers behind it.
When no candidate meets the target, the record also proposes local steps (`propose_local_steps`:
the smallest `--sync-every` whose one all-reduce per period would, `costmodel.choose_sync_every`),
and process 0 prints it: changing the synchronisation period changes what the run computes, so the
controller proposes it and the user decides.

The user decides by `--sync-every auto`: then the CLI asks `decide_sync_every` once, at the start
of a fresh run, and applies its H (`costmodel.auto_sync_every`: 1 if one all-reduce per step fits
the target, else the next power of two at or above `choose_sync_every`'s H, at most
`costmodel.MAX_AUTO_SYNC_EVERY`), logged as an "event": "local_steps" record
(`local_steps_record`, a pure function of the gathered figures, so every process takes the same
decision). With `--compression auto` the compression decision comes first: if its choice fits,
H = 1; otherwise the pseudo-gradient's codec is chosen with H (`Controller.choose_local_steps`:
none, bf16, on a ring int8 / int4, and, when the outer optimizer has no momentum (SparseLoCo's
outer SGD), top-k pseudo-gradients with 2-bit values and a decayed error feedback, each kept only
if the quality guard's replay passes costmodel.PSEUDO_GUARD_THRESHOLD; not PowerSGD), and the
periodic re-decisions are skipped for the run: they would plan per-step communication that local
steps no longer do. With `--overlap`, H is sized for an average
hidden behind the next round. A resumed run takes H and the codec from its checkpoint and
measures nothing (jaxdp/loop/trainer.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdp import moved
from jaxdp.mesh import data_axes, state_specs
from jaxdp.sync import codecs, costmodel, rules
from jaxdp.sync.codecs.base import CompressionState, Compressor, rows as slot_rows, uncompressed_bytes
from jaxdp.sync.collectives import as_collective

GUARD_BATCHES = costmodel.GUARD_WINDOW  # batches the guard sums over (each: one uncompressed all-reduce)
COMPUTE_REPEATS = 5
COMM_REPEATS = 3


@dataclasses.dataclass
class Decision:
    compressor: Compressor | None    # None: plain averaging
    record: dict[str, Any]                        # what the metrics file gets


class Controller:
    """Measures and decides; `jaxdp.train` swaps in the step for `Decision.compressor`."""

    def __init__(self, local_grads: Callable, mesh: Mesh, strategy: Callable, params: Any, *,
                 target_fraction: float = costmodel.TARGET_COMM_FRACTION,
                 guard_threshold: float = costmodel.GUARD_THRESHOLD):
        self.mesh, self.axis, self.n = mesh, data_axes(mesh), mesh.size
        self.total = as_collective(strategy).sum
        self.abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        # int8 / int4 need a strategy that requantizes at every hop (the ring's coded_sum)
        abilities = rules.abilities(strategy)
        self.candidates = costmodel.ladder(self.abstract, quantized_devices=self.n if "coded_sum" in abilities else None,
                                           devices=self.n, abilities=abilities)
        # local steps' top-k pseudo-gradients (SparseLoCo's form), each guarded at PSEUDO_GUARD_THRESHOLD
        self.pseudo_topk = costmodel.pseudo_topk(self.abstract, self.n, abilities)
        self.target_fraction, self.guard_threshold = target_fraction, guard_threshold
        self.grad_bytes = uncompressed_bytes(self.abstract)
        axis = self.axis

        def compute(state: Any, batch: Any) -> jax.Array:  # forward + backward, no collective
            _, _, grads = local_grads(state, batch)
            return sum(jnp.sum(g) for g in jax.tree.leaves(grads))[None]

        def compute_all(state: Any, batch: Any) -> jax.Array:
            return jax.shard_map(compute, mesh=mesh, in_specs=(state_specs(state, axis), P(axis)), out_specs=P(axis),
                                 check_vma=False)(state, batch)

        self._compute = jax.jit(compute_all)

        def allreduce(buffer: jax.Array) -> jax.Array:
            return self.total(buffer, axis)

        self._allreduce = jax.jit(jax.shard_map(allreduce, mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                                                check_vma=False))
        self._local_grads = local_grads
        self._truth: Callable | None = None
        self._replays: dict[str, Callable] = {}
        self._window: tuple[Any, Any] | None = None  # (state, its truth) of the last guarded decision

    # -- measuring ------------------------------------------------------------------------------

    def measure(self, state: Any, batch: Any) -> dict[str, float]:
        """Seconds of compute and of all-reduces of two sizes; the slowest process's figures."""
        state = state.replace(opt_state=None)  # the probes read parameters and model state only
        compute_s = _fastest_time(lambda: self._compute(state, batch), COMPUTE_REPEATS)
        sizes = [max(self.grad_bytes // 16, 1 << 12), max(self.grad_bytes, 1 << 16)]
        comm_s = []
        for nbytes in sizes:
            floats = -(-nbytes // 4)
            buffer = jax.device_put(np.zeros((self.n * floats,), np.float32), NamedSharding(self.mesh, P(self.axis)))
            comm_s.append(_fastest_time(lambda b=buffer: self._allreduce(b), COMM_REPEATS))
        figures = _over_processes(np.asarray([compute_s, *comm_s], np.float64), np.max)
        return {"compute_s": float(figures[0]), "comm_small_s": float(figures[1]), "comm_full_s": float(figures[2]),
                "comm_sizes": [int(-(-s // 4) * 4) for s in sizes]}

    # -- deciding -------------------------------------------------------------------------------

    def decide(self, state: Any, batches: list[Any], step: int, guard_misses: bool = True) -> Decision:
        """Measure on `batches[0]`, plan, and guard a PowerSGD choice on `batches` (the same
        decision on every process). `state` is not changed. `guard_misses=False`: a choice that
        misses the target is not guarded (`--sync-every auto` then uses local steps instead)."""
        started = time.perf_counter()
        figures = self.measure(state, batches[0])
        measured = time.perf_counter()
        model = costmodel.comm_model(figures)
        choice, reasons = costmodel.plan(figures["compute_s"], model, self.abstract, self.candidates,
                                           self.target_fraction)
        checks, planned = [], choice
        if codecs.row(choice.name).guarded and (reasons["fits"] or guard_misses):
            # The quality guard: the true means once; then the choice and the candidates before it
            # (a denser top-k, PowerSGD's higher ranks), in order, until one passes or the ladder
            # reaches one the guard does not replay (int4, bf16, ...).
            truth = self.truth(state, batches)
            self._window = (state, truth)  # local steps' guard reads the same window (choose_local_steps)
            for candidate in self.candidates[self.candidates.index(choice)::-1]:  # from the choice upwards
                choice = candidate
                if not codecs.row(candidate.name).guarded:
                    break
                error = self.replay(candidate, truth)
                checks.append({"candidate": candidate.name, "relative_error": error})
                if costmodel.guard(candidate, error, self.guard_threshold, self.candidates) == candidate:
                    break
        cost_s = {"measure": measured - started, "quality": time.perf_counter() - measured}
        why = reasons["why"]
        if choice != planned:  # the guard stepped back: say so, with the errors that made it
            errors = ", ".join(f"{c['candidate']} {c['relative_error']:.3g}" for c in checks)
            why = (f"{choice.name}: the quality guard stepped back from {planned.name} (relative errors {errors} "
                   f"against {self.guard_threshold:g}); the plan was {why}")
        # Whether the final choice meets the target: the guard may have stepped back to one that
        # does not (on the 100 Mbit/s testbed, from PowerSGD to int4), and then local steps are next.
        fits = reasons["predicted_s"][choice.name] <= reasons["target_s"]
        proposal = None
        if not fits:  # even the chosen compression misses the target: local steps would be next
            sync_every = costmodel.choose_sync_every(figures["compute_s"], model, reasons["payload_bytes"][choice.name],
                                                     choice.collectives, self.target_fraction)
            proposal = {"sync_every": sync_every,
                        "why": f"{choice.name} still predicts {reasons['predicted_s'][choice.name] * 1e3:.3g} ms of "
                               f"all-reduce per step against a target of {reasons['target_s'] * 1e3:.3g} ms; averaging "
                               f"every {sync_every} steps (--sync-every {sync_every}, local steps) would meet it"}
        record = {"choice": choice.name, **figures, "propose_local_steps": proposal, "latency_s": model.latency_s,
                  "bandwidth_bytes_per_s": 1 / model.seconds_per_byte if model.seconds_per_byte else None,
                  "target_fraction": self.target_fraction, "predicted_s": reasons["predicted_s"],
                  "payload_bytes": reasons["payload_bytes"], "uncompressed_bytes": self.grad_bytes,
                  "fits": fits, "why": why, "planned": planned.name, "quality_checks": checks,
                  "guard_threshold": self.guard_threshold, "cost_s": cost_s}
        return Decision(None if choice.name == "none" else choice, record)

    def decide_sync_every(self, state: Any, batches: list[Any], step: int, compressor: Any = None,
                          auto_compression: bool = False, overlap: bool = False,
                          outer_momentum_free: bool = True) -> tuple[Decision | None, dict[str, Any]]:
        """`--sync-every auto` at the start of a fresh run: (the `--compression auto` decision, when
        asked for, else None; the "local_steps" record, whose "sync_every" is H and whose
        "pseudo_gradient" names the codec local steps send their pseudo-gradient through).

        With `auto_compression`, compression is decided first, as `decide` does; H = 1 if its choice
        fits the target. Otherwise local steps, and the pseudo-gradient's codec is chosen with H
        (`costmodel.choose_local_steps`) among none, bf16 and the quantized codecs of the ladder
        (int8, int4 on a ring): they send every value, rounded, with error feedback; PowerSGD is
        not offered, since the quality guard measures gradients, not pseudo-gradients. With a fixed
        `compressor` (None: plain), one measurement and H for that compressor's payload. With
        `overlap` (`--overlap`), H is sized for an average hidden behind the next round
        (costmodel.OVERLAP_ALLOWANCE); without, the record proposes it where it would pay.
        `outer_momentum_free`: the outer optimizer
        applies each average alone (`momentum_free`); only then may local steps choose top-k
        pseudo-gradients (`choose_local_steps`). `state` is a synchronous state (H = 1); it is not changed."""
        if auto_compression:
            # A choice that misses the target means local steps, which do not use it: no guard then.
            decision = self.decide(state, batches, step, guard_misses=False)
            figures = decision.record
            if figures["fits"]:
                chosen = decision.compressor or codecs.parse("none")
                record = costmodel.local_steps_record(figures, chosen.name, chosen.payload_bytes(self.abstract),
                                                      chosen.collectives, self.target_fraction)
                note = "; nothing to overlap" if overlap else ""
                return decision, {**record, "overlap": False, "propose_overlap": None, "sync_every": 1,
                                  "why": f"synchronous: --compression auto chose {chosen.name}, which meets the target "
                                         f"({figures['why']}){note}"}
            # Plain averaging misses the target too (else plan would have chosen it): H > 1.
            record = self.choose_local_steps(state, batches, figures, overlap, outer_momentum_free)
            # The step compresses nothing: local steps replace the plan. The compression record says
            # so, and carries no proposal of its own (its H was sized for a codec not applied).
            planned, taken = figures["why"], {"sync_every": record["sync_every"], "pseudo_gradient": record["pseudo_gradient"]}
            decision.record.update(
                applied=False, propose_local_steps=None, superseded_by={"event": "local_steps", **taken},
                why=f"not applied: --sync-every auto trains with local steps instead (every {taken['sync_every']} "
                    f"steps, the pseudo-gradient through {taken['pseudo_gradient']}: the \"local_steps\" record); "
                    f"per step, the plan was {planned}")
            return decision, {**record, "why": f"{record['why']}; no compression meets the target at every step "
                              f"({planned})"}
        figures = self.measure(state, batches[0])
        chosen = compressor or codecs.parse("none")
        return None, costmodel.choose_local_steps(figures, costmodel.options([chosen], self.abstract),
                                                  self.target_fraction, overlap)

    def choose_local_steps(self, state: Any, batches: list[Any], figures: dict[str, Any], overlap: bool,
                           outer_momentum_free: bool = True) -> dict[str, Any]:
        """`costmodel.choose_local_steps` over the pseudo-gradient codecs auto may use: the ladder's
        that send every value (none, bf16, int8, int4) and, when the outer optimizer applies each
        average alone (`outer_momentum_free`: SparseLoCo's outer SGD, whose momentum the error
        feedback's decay replaces; with DiLoCo's Nesterov the GPT testbed ended far above the
        synchronous loss: docs/perf/calibration.md), the top-k ones (`self.pseudo_topk`). A top-k choice must pass the quality
        guard (`truth` once, then `replay` at costmodel.PSEUDO_GUARD_THRESHOLD); one that fails is
        dropped with every sparser one, and the choice is made again. The record carries the checks
        ("quality_checks")."""
        dense = [c for c in self.candidates if costmodel.pseudo_gradient_codec(c)]
        sparse, checks = list(self.pseudo_topk) if outer_momentum_free else [], []
        truth = self._window[1] if self._window is not None and self._window[0] is state else None
        while True:
            record = costmodel.choose_local_steps(figures, costmodel.options(dense + sparse, self.abstract),
                                                  self.target_fraction, overlap, [c.name for c in sparse])
            chosen = next((c for c in sparse if c.name == record["pseudo_gradient"]), None)
            if chosen is None:
                break
            truth = self.truth(state, batches) if truth is None else truth
            error = self.replay(chosen, truth)
            checks.append({"candidate": chosen.name, "relative_error": error})
            if error <= costmodel.PSEUDO_GUARD_THRESHOLD:
                break
            sparse = sparse[:sparse.index(chosen)]
        if checks:
            passed = checks[-1]["relative_error"] <= costmodel.PSEUDO_GUARD_THRESHOLD
            said = ", ".join(f"{c['candidate']} {c['relative_error']:.3g}" for c in checks)
            record["why"] = (f"{record['why']}; the quality guard replayed top-k pseudo-gradients ({said} against "
                             f"{costmodel.PSEUDO_GUARD_THRESHOLD:g}): "
                             + (f"kept {checks[-1]['candidate']}" if passed else "kept none of them"))
        elif self.pseudo_topk and not outer_momentum_free:
            record["why"] = (f"{record['why']}; top-k pseudo-gradients were not offered: their error feedback's decay "
                             f"stands in for the outer momentum, so they need an outer optimizer without one "
                             f"(--outer-optimizer sgd --outer-lr 1 --outer-momentum 0, SparseLoCo's)")
        record.update(quality_checks=checks, pseudo_guard_threshold=costmodel.PSEUDO_GUARD_THRESHOLD)
        return record

    def truth(self, state: Any, batches: list[Any]) -> tuple[list[Any], Any, Any]:
        """What every candidate's check reads: the true mean gradient of each of GUARD_BATCHES
        batches (one uncompressed all-reduce each), the devices' mean error feedback (one more), and
        the shared Q; all replicated: the guard's whole communication.

        PowerSGD through an all-reduce is linear in its input: with one shared Q, the all-reduced
        P = sum_i (M_i + e_i) Q = (sum_i M_i + e_i) Q, so every device ends with exactly the
        approximation that compressing the devices' mean (gradient + error) on one device gives, and
        the mean error moves as that device's error would. So the candidates are checked on the
        means with no collective at all (`replay`): one small program each, compiled for the ranks
        actually checked, instead of every rank's collectives in one large program. Top-k is replayed
        the same way, as one device holding the mean would choose its values: the run's devices
        choose from their own gradients (the leader's, or each its own), so for top-k the replay
        approximates (costmodel.GUARD_THRESHOLD)."""
        state = state.replace(opt_state=None)
        if self._truth is None:
            axis, n = self.axis, self.n

            def per_device(state: Any, batch: Any) -> Any:
                _, _, grads = self._local_grads(state, batch)
                return self.total(jax.tree.map(lambda g: g / n, grads), axis)

            self._truth = jax.jit(lambda state, batch: jax.shard_map(
                per_device, mesh=self.mesh, in_specs=(state_specs(state, axis), P(axis)), out_specs=P(),
                check_vma=False)(state, batch))
            self._mean_rows = jax.jit(lambda rows: jax.tree.map(lambda x: jnp.mean(x, axis=0), rows),
                                      out_shardings=NamedSharding(self.mesh, P()))
        means = [self._truth(state, batch) for batch in batches[:GUARD_BATCHES]]
        error, q = slot_rows(state.sync)
        return means, self._mean_rows(error), q

    def replay(self, candidate: Compressor, truth: tuple[list[Any], Any, Any]) -> float:
        """`candidate`'s relative error over the window of `truth` (see `truth`), on every device
        alike: compression of the mean on one device, error feedback threaded, Q held."""
        if candidate.name not in self._replays:
            def replay(means: list[Any], error: Any, q: Any) -> jax.Array:
                applied = []
                for mean in means:
                    stored = CompressionState(error=error, q=q)
                    approx, new, _ = candidate.mean(mean, candidate.read(stored, mean), _one_device, 1,
                                                    candidate.start)  # past any start step: compressed
                    error = candidate.write(stored, new).error
                    applied.append(approx)
                return costmodel.relative_error(_tree_sum(applied), _tree_sum(means))

            self._replays[candidate.name] = jax.jit(replay)
        # The largest over the processes: they compute the replay alike, but a process whose CPU
        # compiled it differently (another instruction set) could differ in the last bit, and a
        # threshold between them would split the decision and hang the run at its first collective.
        return float(_over_processes(np.float32(self._replays[candidate.name](*truth)), np.max))


def momentum_free(outer_tx: Any) -> bool:
    """Whether the outer optimizer `outer_tx` (None: plain averaging) applies each averaged
    pseudo-gradient alone, as -lr times it: two updates of a three-value tree in a row, each a
    constant multiple of its input (no momentum, no weight decay, no schedule between them)."""
    if outer_tx is None:
        return True
    x = {"p": jnp.ones(3, jnp.float32)}
    first, second = {"p": jnp.asarray([1.0, -2.0, 3.0])}, {"p": jnp.asarray([-0.5, 4.0, 1.0])}
    u1, state = outer_tx.update(first, outer_tx.init(x), x)
    u2, _ = outer_tx.update(second, state, x)
    ratios = np.concatenate([np.asarray(u1["p"]) / np.asarray(first["p"]), np.asarray(u2["p"]) / np.asarray(second["p"])])
    return bool(ratios[0] < 0 and np.allclose(ratios, ratios[0], rtol=1e-6, atol=0))


def _one_device(buffer: Any, wire: Any = None) -> Any:
    """A collective over one device, as a replay hands it to a codec: the sum is the buffer itself,
    or for a coded ring (`wire`: top-k's quantized values) its one encoding and what that left out."""
    if wire is None:
        return buffer
    left = wire.encode(buffer)[1]
    return buffer - left, left


def _over_processes(value: np.ndarray, reduce: Callable[..., np.ndarray]) -> np.ndarray:
    """`reduce` (np.max, np.min) of every process's `value` (same shape everywhere), elementwise:
    one figure that every process decides from alike. `value` itself with one process."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return reduce(np.asarray(multihost_utils.process_allgather(value)).reshape(-1, *np.shape(value)), axis=0)


def _tree_sum(trees: list[Any]) -> Any:
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *trees)


def _fastest_time(fn: Callable[[], Any], repeats: int, budget_s: float = 0.25, most: int = 50) -> float:
    """The fastest of at least `repeats` runs of `fn`, and of as many more as fit in `budget_s`
    (at most `most` in all): a cheap probe (an all-reduce on a fast link, a small model's step)
    gets many tries at a quiet moment of a busy machine; a slow one (a large buffer over a slow
    link) costs only `repeats`.

    `fn` may be a collective, so every process runs it the same number of times: how many more
    fit is decided once, after the first `repeats`, as the smallest count over the processes.
    (A count that each process decided from its own clock once left one process in an
    all-reduce that the other never joined.)"""
    jax.block_until_ready(fn())  # compile and warm up
    started = time.perf_counter()
    times = [_timed(fn) for _ in range(repeats)]
    left = budget_s - (time.perf_counter() - started)
    fit = max(0, min(most - repeats, int(left / max(min(times), 1e-9))))
    more = int(_over_processes(np.int32(fit), np.min))  # the same count on every process
    times += [_timed(fn) for _ in range(more)]
    return min(times)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


# `start` and `Start` were this module's until the run-start policy got a module of its own.
__getattr__ = moved.forwarder(__name__, {"start": "jaxdp.sync.autostart", "Start": "jaxdp.sync.autostart"})
