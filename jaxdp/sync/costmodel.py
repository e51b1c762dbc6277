"""The cost model: predictions and decisions from measured figures, pure (nothing is measured here).

    model = fit_comm_model([1 << 20, 16 << 20], [t_small, t_large])   # latency + bytes / bandwidth
    choice, reasons = plan(compute_seconds, model, params)            # the least compression that fits
    choice = guard(choice, relative_error(applied_sum, true_sum))     # step back if it loses too much
    h = auto_sync_every(compute_seconds, model, payload_bytes)        # --sync-every auto's H
    record = choose_local_steps(figures, options(codecs, params), target, overlap)  # ... and its codec

jaxdp/sync/predict.py applies them to a described cluster (`python -m jaxdp.bench plan`);
jaxdp/sync/controller.py measures on the run's devices and calls these; every process decides from the
same gathered figures, so every process takes the same decision. The numbers behind each
threshold are written beside it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp import moved
from jaxdp.sync import codecs
from jaxdp.sync.codecs.base import Compressor, uncompressed_bytes

Tree = Any

# The ranks `ladder` offers, from least to most compression (Vogels et al. use 1 to 4 for
# ResNet/LSTM; 32 is already close to uncompressed for most layers of small models).
DEFAULT_RANKS = (32, 16, 8, 4, 2, 1)

# plan(): the largest predicted all-reduce time, as a fraction of the compute time, we accept
# without compressing more. jaxdp's step does not overlap the all-reduce with the backward pass,
# so a step takes compute + comm: 0.25 keeps scaling efficiency at or above 1 / 1.25 = 80 %, the
# usual bar for "scales well", while never compressing a run whose link already keeps up (every
# extra step of compression costs matmuls and some gradient quality).
TARGET_COMM_FRACTION = 0.25

# When plain averaging misses the target, compress only if the chosen candidate's predicted step
# (compute + all-reduce) is at least this much shorter than plain averaging's: the prediction
# leaves out compression's own work (casts, PowerSGD's matmuls) and its cost in gradient quality,
# and times measured on a shared machine vary from run to run by about as much (docs/performance.md,
# "The CPU machine"); a smaller predicted gain pays for none of that. A latency-bound link
# (simulated devices in one process, where an all-reduce costs about the same at any size) is
# exactly such a case: there, none.
MIN_STEP_GAIN = 0.20

# guard(): the threshold on the relative error of a window's summed compressed means against its
# summed true means, as jaxdp/sync/controller.py measures it: GUARD_WINDOW batches at the current
# parameters, error feedback threaded through them (so the error is exactly the change of the
# devices' mean error over the window: the progress still owed). Calibrated on the GPT of
# `python -m jaxdp.bench compression` so that it stops the ranks whose held-out loss ran away and
# passes those that matched uncompressed, at the first step and later alike (docs/perf/calibration.md).
# Never give guard the per-step error of one batch without error feedback: it is large at any rank.
# Top-k: the same replay (as one device holding the mean would choose: an approximation) and threshold;
# an error costs about as much held-out loss in either family.
GUARD_THRESHOLD = 0.05
GUARD_WINDOW = 4

# The quality guard of local steps' top-k pseudo-gradients (codecs.topk.TopK.pseudo_candidates): the
# same replay (GUARD_WINDOW mean gradients, the candidate's error feedback and its decay threaded) at a
# threshold of its own. A pseudo-gradient sums H steps, so its large entries stand out of the
# per-step noise that a gradient's replay counts as error; with error feedback what is not sent
# waits, and with the decay it fades. Calibrated on the GPT testbed's model (python -m jaxdp.bench
# localsgd's, outer SGD at lr 1 without momentum): the threshold keeps the densities whose held-out
# loss ends below auto's choice without top-k, and refuses those above (docs/perf/calibration.md).
PSEUDO_GUARD_THRESHOLD = 0.6

# The largest H that --sync-every auto applies. Local steps trade loss for time: at 10 Mbit/s H = 16
# with plain averaging stayed near the synchronous held-out loss in a fraction of its time
# (docs/slow-links.md, "Local steps"). Once the all-reduce per step is below the compute, a
# doubling of H buys at most a few percent of wall time while the loss keeps drifting from the
# synchronous run's. A user who wants a larger H passes it explicitly (--sync-every 64).
MAX_AUTO_SYNC_EVERY = 16

# ladder(): int8 and int4 join the ladder (ring strategies only: they requantize at every hop)
# while their one-step error before feedback, Quantized.error_bound(devices), is at most this
# fraction of a block's largest sum: int4 up to 4 devices on the ring (14.8 % at 2, 31.7 % at 4,
# 74 % at 8), int8 up to 76. Error feedback sends what a step left out at the next step, so the
# applied sum over a run is exact up to the last step's error (jaxdp.sync.codecs.quantized.Quantized); but
# past this bound the error carried from step to step is as large as the gradient itself, and
# PowerSGD's guarded ranks are the better bet. They are not replayed by the quality guard: the
# replay's shortcut (a compressed mean equals the mean of compressed parts) holds for PowerSGD's
# linear projections, not for rounding at every hop (docs/slow-links.md, "int8 and int4").
QUANT_BOUND = 0.35

# --overlap with --sync-every auto: the average runs behind the next round, so it may take this
# many times the target (comm_target x compute per step): half the round's compute at the default
# 0.25. Not all of the round: the average shares the process's core (quantizing, copies in and out
# of the collective) and a round's compute varies (docs/slow-links.md, "Overlap").
OVERLAP_ALLOWANCE = 2.0



@dataclasses.dataclass(frozen=True)
class CommModel:
    """All-reduce time = calls * latency_s + bytes * seconds_per_byte."""

    latency_s: float
    seconds_per_byte: float

    def seconds(self, nbytes: int, calls: int = 1) -> float:
        return calls * self.latency_s + nbytes * self.seconds_per_byte


def fit_comm_model(sizes_bytes: Sequence[int], seconds: Sequence[float]) -> CommModel:
    """Least-squares line through measured (bytes, seconds) all-reduce times, two points or more.
    A negative intercept (noise) becomes 0 latency; times that do not grow with size raise."""
    x, y = np.asarray(sizes_bytes, np.float64), np.asarray(seconds, np.float64)
    if x.shape != y.shape or x.size < 2 or np.unique(x).size < 2:
        raise ValueError("fit_comm_model needs all-reduce times for at least two different sizes")
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:
        raise ValueError("fit_comm_model: the measured times do not grow with size; measure larger buffers")
    return CommModel(latency_s=max(float(intercept), 0.0), seconds_per_byte=float(slope))


def ladder(params: Tree, ranks: Sequence[int] = DEFAULT_RANKS, start: int = 0,
           quantized_devices: int | None = None, devices: int | None = None,
           abilities: Collection[str] | None = None) -> list[Compressor]:
    """Candidates from least to most compression: none, bf16, (with `quantized_devices`, the
    device count of a ring that can requantize at every hop) int8 and int4 where their error bound
    allows (QUANT_BOUND), PowerSGD at decreasing ranks, then top-k at decreasing densities. A rank
    is left out when it is no smaller than the largest matrix's min(n, m) (it would be that
    matrix's full rank); a rank or a density when it moves no fewer bytes than the candidate
    before it (int4's payload, a higher rank's, PowerSGD's lowest rank's). With `devices` (the
    run's device count) each candidate is the one that runs there (`Compressor.settled`: top-k's
    form); with `abilities` (jaxdp.sync.rules.abilities of the strategy), those it cannot carry
    are left out."""
    out: list[Compressor] = []
    last_bytes = None
    for row, members in offered(params, ranks, start, quantized_devices, QUANT_BOUND):
        for candidate in members:
            if devices is not None:
                candidate = candidate.settled(params, devices, False)
            if abilities is not None and candidate.needs not in abilities:
                continue
            payload = candidate.payload_bytes(params)
            if row.fewer_bytes and last_bytes is not None and payload >= last_bytes:
                continue
            out.append(candidate)
            last_bytes = payload if row.ladder > 0 else last_bytes
    return out


def offered(params: Tree, ranks: Sequence[int] = DEFAULT_RANKS, start: int = 0, ring_devices: int | None = None,
            bound: float = math.inf) -> list[tuple[Any, list[Compressor]]]:
    """(row, its candidates) for every row of the codec table's ladder, in ladder order: what each
    codec family offers for `params` (jaxdp/sync/codecs/__init__.py), before `ladder`'s byte rule."""
    return [(row, row.load().candidates(row.name, params, ranks=ranks, start=start, ring_devices=ring_devices,
                                        bound=bound)) for row in codecs.ladder_rows()]


def auto_slot(params: Tree) -> Any:
    """One device's slot for `--compression auto`: one that serves every candidate the ladder may
    offer (on any ring, at any error bound), each family's `serving` slot merged
    (jaxdp.sync.codecs.base.auto_slot)."""
    from jaxdp.sync.codecs.base import auto_slot as merged

    families: dict[type, list[Compressor]] = {}
    for row, members in offered(params, ring_devices=2):
        families.setdefault(row.load(), []).extend(members)
    return merged(params, list(families.items()))  # in ladder order: int8's error rows (every leaf) first


def plan(compute_seconds: float, comm_model: CommModel, params: Tree, candidates: Sequence[Compressor] | None = None,
         target_fraction: float = TARGET_COMM_FRACTION) -> tuple[Compressor, dict]:
    """The first candidate (least compression first) whose predicted all-reduce time is at most
    `target_fraction * compute_seconds`, or if none is, the one with the shortest predicted step
    (compute + all-reduce); but the first candidate (plain averaging) unless the choice's step is
    at least MIN_STEP_GAIN shorter than its. Reasons say which and why.

    reasons: {"compute_s", "target_s", "predicted_s": {name: seconds}, "payload_bytes": {name: bytes},
    "uncompressed_bytes", "chosen", "fits": bool, "why": a sentence}.
    """
    candidates = list(ladder(params) if candidates is None else candidates)
    if not candidates:
        raise ValueError("plan needs at least one candidate")
    target = target_fraction * compute_seconds
    payload = {c.name: c.payload_bytes(params) for c in candidates}
    predicted = {c.name: comm_model.seconds(payload[c.name], c.collectives) for c in candidates}
    reasons = {"compute_s": compute_seconds, "target_s": target, "predicted_s": predicted, "payload_bytes": payload,
               "uncompressed_bytes": uncompressed_bytes(params)}
    step = {name: compute_seconds + t for name, t in predicted.items()}
    plain = candidates[0]
    fitting = [c for c in candidates if predicted[c.name] <= target]
    if plain in fitting:
        why = (f"{plain.name}: predicted all-reduce {predicted[plain.name] * 1e3:.3g} ms <= {target_fraction:g} x compute "
               f"{compute_seconds * 1e3:.3g} ms")
        return plain, {**reasons, "chosen": plain.name, "fits": True, "why": why}
    fastest = min(candidates, key=lambda c: step[c.name])  # the first of equals: the least compression
    choice = fitting[0] if fitting else fastest
    gain = 1 - step[choice.name] / step[plain.name]
    if gain < MIN_STEP_GAIN:
        why = (f"{plain.name}: the best candidate ({choice.name}) predicts a step only {gain:.0%} shorter (< "
               f"{MIN_STEP_GAIN:.0%}); the all-reduce costs latency more than bandwidth here")
        return plain, {**reasons, "chosen": plain.name, "fits": False, "why": why}
    if fitting:
        why = (f"{choice.name}: predicted all-reduce {predicted[choice.name] * 1e3:.3g} ms <= {target_fraction:g} x "
               f"compute {compute_seconds * 1e3:.3g} ms, the least compression that fits; a step {gain:.0%} shorter")
    else:
        why = (f"{choice.name}: no candidate fits {target_fraction:g} x compute {compute_seconds * 1e3:.3g} ms; it predicts "
               f"the shortest step, {gain:.0%} shorter than {plain.name} (communication still dominates: fewer "
               f"synchronisations, e.g. local steps, would be next)")
    return choice, {**reasons, "chosen": choice.name, "fits": bool(fitting), "why": why}


def relative_error(approx_mean: Tree, true_mean: Tree) -> jax.Array:
    """float32 ||approx - true|| / ||true|| over the whole tree (global norms); 0 when both are 0."""
    diff = sum(jnp.sum(jnp.square(jnp.asarray(a, jnp.float32) - jnp.asarray(t, jnp.float32)))
               for a, t in zip(jax.tree.leaves(approx_mean), jax.tree.leaves(true_mean)))
    true = sum(jnp.sum(jnp.square(jnp.asarray(t, jnp.float32))) for t in jax.tree.leaves(true_mean))
    return jnp.sqrt(jnp.asarray(diff, jnp.float32) / jnp.maximum(jnp.asarray(true, jnp.float32), jnp.finfo(jnp.float32).tiny))


def weaker(choice: Compressor, candidates: Sequence[Compressor] | None = None) -> Compressor:
    """The next candidate with less compression: the previous one in `candidates` when `choice` is
    in it; otherwise PowerSGD rank r -> 2r (up to the largest of DEFAULT_RANKS), then bf16, then
    none; int4 -> int8 -> bf16."""
    candidates = list(candidates or [])
    if choice in candidates:
        return candidates[max(candidates.index(choice) - 1, 0)]
    return choice.weaker(DEFAULT_RANKS)


def guard(choice: Compressor, rel_error: float, threshold: float = GUARD_THRESHOLD,
          candidates: Sequence[Compressor] | None = None) -> Compressor:
    """`choice` while `rel_error <= threshold`; above it, the next weaker candidate (`weaker`).
    Give it `running_sum_error` for PowerSGD (see GUARD_THRESHOLD); a NaN error steps back too."""
    if float(rel_error) <= threshold:
        return choice
    return weaker(choice, candidates)


def choose_sync_every(compute_seconds: float, comm_model: Any, payload_bytes: int, collectives: int = 1,
                      target_fraction: float | None = None, max_sync_every: int = 1024) -> int:
    """The smallest H whose predicted per-step communication is at most `target_fraction` (default:
    TARGET_COMM_FRACTION) of the compute time, capped at `max_sync_every`."""
    target = (TARGET_COMM_FRACTION if target_fraction is None else target_fraction) * compute_seconds
    per_sync = comm_model.seconds(payload_bytes, collectives)
    if target <= 0:
        return max_sync_every
    return int(min(max(1, math.ceil(per_sync / target)), max_sync_every))


def auto_sync_every(compute_seconds: float, comm_model: Any, payload_bytes: int, collectives: int = 1,
                    target_fraction: float | None = None, max_sync_every: int = MAX_AUTO_SYNC_EVERY) -> dict[str, Any]:
    """The H of `--sync-every auto`, a pure function of measured figures (so every process that has
    the same gathered figures takes the same decision), and the numbers behind it.

    1 when one all-reduce of `payload_bytes` (in `collectives` calls) per step is at most
    `target_fraction` (default TARGET_COMM_FRACTION) of `compute_seconds`: the
    normal synchronous step. Otherwise the smallest power of two >= `choose_sync_every(...)`,
    capped at `max_sync_every`. Powers of two: a handful of values across runs and machines whose
    figures differ by a little, and every divisor a later `--sync-fragments` might want.

    Returns {"sync_every", "uncapped_sync_every" (choose_sync_every's H, no power of two, no cap),
    "fits" (the chosen H meets the target), "comm_per_sync_s", "predicted_comm_s" (per step at the
    chosen H), "target_s", "why"}.
    """
    fraction = TARGET_COMM_FRACTION if target_fraction is None else target_fraction
    target = fraction * compute_seconds
    per_sync = comm_model.seconds(payload_bytes, collectives)
    needed = choose_sync_every(compute_seconds, comm_model, payload_bytes, collectives, fraction, max_sync_every=1 << 30)
    sync_every = 1 if needed == 1 else min(1 << (needed - 1).bit_length(), max_sync_every)
    predicted = per_sync / sync_every
    numbers = (f"one all-reduce of {payload_bytes} bytes predicts {per_sync * 1e3:.3g} ms against a target of "
               f"{fraction:g} x compute {compute_seconds * 1e3:.3g} ms = {target * 1e3:.3g} ms per step")
    if sync_every == 1:
        why = f"synchronous: {numbers}"
    elif sync_every < needed:
        why = (f"local steps, averaged every {sync_every} steps (the cap, MAX_AUTO_SYNC_EVERY): {numbers}; meeting it "
               f"would take H = {needed} ({predicted * 1e3:.3g} ms per step at H = {sync_every}); pass --sync-every "
               f"{needed} for that")
    else:
        why = (f"local steps, averaged every {sync_every} steps: {numbers}; H = {needed} would meet it, rounded up to a "
               f"power of two: {predicted * 1e3:.3g} ms per step")
    return {"sync_every": sync_every, "uncapped_sync_every": needed, "fits": predicted <= target,
            "comm_per_sync_s": per_sync, "predicted_comm_s": predicted, "target_s": target, "why": why}


def comm_model(figures: dict[str, Any]) -> CommModel:
    """The all-reduce time line through `measure`'s two sizes (latency alone if the times do not
    grow with size: a fast link)."""
    try:
        return fit_comm_model(figures["comm_sizes"], [figures["comm_small_s"], figures["comm_full_s"]])
    except ValueError:
        return CommModel(latency_s=figures["comm_full_s"], seconds_per_byte=0.0)


def local_steps_record(figures: dict[str, Any], pseudo_gradient: str, payload_bytes: int, collectives: int,
                       target_fraction: float) -> dict[str, Any]:
    """The "local_steps" record of `--sync-every auto`: H (`auto_sync_every`, a pure function
    of `measure`'s gathered figures, so every process takes the same decision) and the numbers
    behind it. `pseudo_gradient` names the compression the pseudo-gradient (or, at H = 1, the
    gradient) goes through, `payload_bytes` and `collectives` what it sends per average."""
    model = comm_model(figures)
    choice = auto_sync_every(figures["compute_s"], model, payload_bytes, collectives, target_fraction)
    return {"sync_every": choice["sync_every"], "why": choice["why"], "compute_s": figures["compute_s"],
            "comm_full_s": figures["comm_full_s"], "latency_s": model.latency_s,
            "bandwidth_bytes_per_s": 1 / model.seconds_per_byte if model.seconds_per_byte else None,
            "pseudo_gradient": pseudo_gradient, "payload_bytes": payload_bytes, "collectives": collectives,
            "comm_per_sync_s": choice["comm_per_sync_s"], "predicted_comm_s": choice["predicted_comm_s"],
            "target_fraction": target_fraction, "target_s": choice["target_s"], "fits": choice["fits"],
            "uncapped_sync_every": choice["uncapped_sync_every"], "max_sync_every": MAX_AUTO_SYNC_EVERY}


def pseudo_gradient_codec(codec: Compressor) -> bool:
    """Whether local steps may send their pseudo-gradient through `codec` of the auto ladder: every
    value, rounded or not, with error feedback where it keeps any; not one the quality guard replays
    at GUARD_THRESHOLD (PowerSGD, the ladder's float32 top-k: the codec table's `guarded`). Top-k
    pseudo-gradients have candidates of their own (`pseudo_topk`), guarded at PSEUDO_GUARD_THRESHOLD."""
    return not codecs.row(codec.name).guarded


def pseudo_topk(params: Tree, devices: int, abilities: Collection[str] | None = None) -> list[Compressor]:
    """The top-k pseudo-gradient codecs local steps may choose under auto, densest first, each in the
    form that runs on `devices` (`settled`), those `abilities` (the strategy's) cannot carry left out."""
    from jaxdp.sync.codecs.topk import TopK

    out = [c.settled(params, devices, True) for c in TopK.pseudo_candidates(params)]
    return [c for c in out if abilities is None or c.needs in abilities]


def options(codecs: Sequence[Compressor], params: Tree) -> list[tuple[str, int, int]]:
    """`choose_local_steps`'s options: (name, payload bytes, collectives) of each codec."""
    return [(c.name, c.payload_bytes(params), c.collectives) for c in codecs]


def predicted_step_s(compute_seconds: float, comm_per_sync_s: float, sync_every: int, overlap: bool = False) -> float:
    """Seconds per step of local steps at H = `sync_every`: compute plus the per-step share of
    one average, or with `overlap` the longer of the two (the average runs behind the next round)."""
    share = comm_per_sync_s / max(sync_every, 1)
    return max(compute_seconds, share) if overlap and sync_every > 1 else compute_seconds + share


def choose_local_steps(figures: dict[str, Any], options: Sequence[tuple[str, int, int]], target_fraction: float,
                       overlap: bool = False, local_only: Collection[str] = ()) -> dict[str, Any]:
    """`--sync-every auto`'s local steps when the pseudo-gradient's codec is free to choose:
    `options` are (codec name, payload bytes, collectives), least compression first (none, bf16,
    int8, int4). Each gets its H (`auto_sync_every`; with `overlap`, against OVERLAP_ALLOWANCE x
    `target_fraction` of the compute) and its predicted step (`predicted_step_s`). The choice:

    1. the smallest H (fewer local steps between averages stay closer to synchronous training),
    2. among those, the least compression whose predicted step is within MIN_STEP_GAIN of the
       fastest (compression is bought only for a real gain, as in `plan`).

    Returns `local_steps_record` of the choice, plus "options" ({name: {"sync_every",
    "predicted_step_s"}}) and, without `overlap`, "propose_overlap" when `--overlap` would make
    the chosen codec's step at least MIN_STEP_GAIN shorter (with its own H): {"sync_every",
    "predicted_step_s", "why"}, or None. `local_only`: options that take H >= 2 even where the link
    would keep up at every step (top-k pseudo-gradients: at H = 1 they would be every step's
    gradients, which `plan` and its guard decide)."""
    if not options:
        raise ValueError("choose_local_steps needs at least one option")
    model = comm_model(figures)
    compute = figures["compute_s"]
    fraction = OVERLAP_ALLOWANCE * target_fraction if overlap else target_fraction

    def sized(payload: int, collectives: int, hidden: bool, least: int = 1) -> tuple[int, float]:
        plain = auto_sync_every(compute, model, payload, collectives, target_fraction)
        if not hidden or plain["sync_every"] == 1:  # the link keeps up at every step: synchronous
            h = max(plain["sync_every"], least)
            return h, predicted_step_s(compute, plain["comm_per_sync_s"], h)
        choice = auto_sync_every(compute, model, payload, collectives, OVERLAP_ALLOWANCE * target_fraction)
        h = max(choice["sync_every"], 2)  # it misses at every step, and only a next round overlaps an average
        return h, predicted_step_s(compute, choice["comm_per_sync_s"], h, True)

    table = {name: sized(payload, collectives, overlap, 2 if name in local_only else 1)
             for name, payload, collectives in options}
    fewest = min(h for h, _ in table.values())
    fastest = min(s for h, s in table.values() if h == fewest)
    name, payload, collectives = next(o for o in options if table[o[0]][0] == fewest
                                      and table[o[0]][1] * (1 - MIN_STEP_GAIN) <= fastest)
    sync_every, step_s = table[name]
    record = local_steps_record(figures, name, payload, collectives, fraction if sync_every > 1 else target_fraction)
    if sync_every != record["sync_every"] and not overlap:  # local_only: at least 2 (sized)
        record.update(sync_every=sync_every, predicted_comm_s=record["comm_per_sync_s"] / sync_every, fits=True,
                      why=f"local steps, averaged every {sync_every} steps, the fewest for a top-k pseudo-gradient: "
                           f"{record['why'].removeprefix('synchronous: ')}")
    elif sync_every != record["sync_every"]:  # overlapped: at least 2 (sized)
        record.update(sync_every=sync_every, predicted_comm_s=record["comm_per_sync_s"] / sync_every, fits=True,
                      why=f"local steps, averaged every 2 steps, the fewest that overlap: "
                           f"{record['why'].removeprefix('synchronous: ')}")
    record["options"] = {n: {"sync_every": h, "predicted_step_s": s} for n, (h, s) in table.items()}
    record["overlap"], record["predicted_step_s"] = bool(overlap and sync_every > 1), step_s
    if len(options) > 1 and sync_every > 1:
        record["why"] = (f"{record['why']}; the pseudo-gradient goes {name} (predicted step "
                         f"{step_s * 1e3:.3g} ms; " + ", ".join(f"{n}: H = {h}, {s * 1e3:.3g} ms" for n, (h, s)
                                                                in table.items() if n != name) + ")")
    if overlap and sync_every > 1:
        record["why"] = f"{record['why']}; --overlap: the average runs behind the next round"
    proposal = None
    if not overlap and sync_every > 1:
        h, s = sized(payload, collectives, True, 2 if name in local_only else 1)
        if h > 1 and s <= (1 - MIN_STEP_GAIN) * step_s:
            proposal = {"sync_every": h, "predicted_step_s": s,
                        "why": f"--overlap would hide the average behind the next round: a predicted step of "
                               f"{s * 1e3:.3g} ms at H = {h} against {step_s * 1e3:.3g} ms (it applies each average "
                               f"one round late; pass --overlap to take it)"}
    record["propose_overlap"] = proposal
    return record


# `Cluster` and `predict` were this module's until the described cluster got a module of its own.
__getattr__ = moved.forwarder(__name__, {"Cluster": "jaxdp.sync.predict", "predict": "jaxdp.sync.predict"})
