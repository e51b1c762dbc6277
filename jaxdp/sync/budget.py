"""`--byte-budget`: `--sync-every auto --compression auto` under a cap on the bytes sent, a fraction
of what the every-step float32 ring sends (`--byte-budget 0.001`, or `1000x`: 1/1000 of it).

    record = choose(params, devices=2, budget=0.001, abilities=rules.abilities(strategy))
    record["sync_every"], record["pseudo_gradient"], record["why"]

A pure function of the model's shapes, the device count, the budget and what the strategy and
the outer optimizer allow: every process takes the same decision, nothing is measured, and a
rerun chooses the same. Every (H, codec) whose bytes per step fit the budget is an option: H a
power of two up to MAX_SYNC_EVERY; the codec none, bf16, int8 / int4 on a ring that requantizes
at every hop, and (H >= 2, an outer optimizer without momentum) top-k pseudo-gradients at the
densest density that fits (`densest`), in SparseLoCo's form (2-bit values, decayed error feedback).
Among the options the choice is by quality, not bytes (`quality_key`): the fewest local steps first,
then the least compression; a top-k density below MIN_DENSITY counts only where nothing else fits,
and then the densest (the most local steps) first.
The measurements behind the order are in docs/slow-links.md ("--byte-budget").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Collection

from jaxdp.inputs import parse_byte_budget  # noqa: F401 (the grammar, checked before JAX starts)
from jaxdp.sync import codecs, costmodel
from jaxdp.sync.codecs.base import Compressor, bytes_sent, uncompressed_bytes

# The largest H a budget may choose: 1,000x fewer bytes than float32 every step needs H >= 128
# with int4 (about 8x per average), H >= 2 with top-k pseudo-gradients.
MAX_SYNC_EVERY = 256

# Top-k pseudo-gradients sparser than this are taken only where nothing denser fits at any H. At a
# fixed budget the density grows with H (2-bit values: d is about 2.3 x H x budget at 2 devices), so
# the floor sets H: at 1/1000, H = 8 (d = 0.017), which measured best or tied at equal bytes
# (docs/perf/calibration.md). Sparser top-k waits longer to send a value; more local steps drift further.
MIN_DENSITY = 0.015

# The values' bits and the error feedback's decay stay codecs.topk's PSEUDO_BITS and PSEUDO_DECAY (2,
# 0.98): at the same bytes no other decay or precision won consistently (docs/perf/calibration.md).

# The densities `densest` tries: 2 significant digits, from 0.99 down to 1e-5.
_GRID = sorted({round(m * 10.0 ** -e, e) for e in range(2, 7) for m in range(10, 100)}, reverse=True)

# The outer step where no outer optimizer is given: SGD without momentum, at OUTER_LR_TOPK with top-k
# pseudo-gradients, else lr 1 (plain averaging). Top-k delivers only part of each average when it is
# made: a value not picked waits in the error feedback, which fades by the decay at every exchange,
# and a value one device picks reaches the mean at 1/N of its weight where the others did not pick it.
# A larger outer lr gives the step its size back: lr 2 measured better than 1 on three GPTs, run lengths
# and device counts, and not worse on any mean (docs/perf/calibration.md). Without top-k it hurts.
OUTER_LR_TOPK = 2.0

# The logged scalars (loss, gradient norm) a local step averages over the devices between syncs:
# float32 each, counted against the budget.
SCALARS = 2


def ring_bytes(params: Any, devices: int) -> float:
    """What a device sends per step with the every-step float32 ring (bandwidth-optimal)."""
    return bytes_sent(uncompressed_bytes(params), devices)


def sent_per_step(codec: Compressor, params: Any, devices: int, sync_every: int, scalars: bool = True) -> float:
    """What a device sends per step with `codec` once every `sync_every` steps, the logged scalars
    between syncs included (SCALARS; none at H = 1, where they ride the step's own all-reduce, nor
    without `scalars`: --metrics-at-sync)."""
    per_sync = bytes_sent(codec.payload_bytes(params, devices), devices)
    between = bytes_sent(4 * SCALARS, devices) if sync_every > 1 and scalars else 0.0
    return per_sync / sync_every + between * (sync_every - 1) / sync_every


def outer_lr(pseudo_gradient: str | None) -> float:
    """The outer SGD's lr under a budget with no outer optimizer given: OUTER_LR_TOPK where the
    pseudo-gradient goes through top-k, else 1 (plain averaging)."""
    return OUTER_LR_TOPK if pseudo_gradient is not None and pseudo_gradient.startswith("topk") else 1.0


def outer_words(lr: float) -> str:
    """The outer step of `outer_lr` in a console line's words."""
    return (f"SGD at lr {lr:g}, no momentum (top-k delivers part of each average late, through its decaying error "
            f"feedback; --outer-optimizer sgd --outer-lr sets another)" if lr != 1 else
            "plain averaging (SGD at lr 1, no momentum; --outer-optimizer sets another)")


def densest(params: Any, devices: int, sync_every: int, allowed: float, abilities: Collection[str] | None = None,
            scalars: bool = True) -> Compressor | None:
    """The top-k pseudo-gradient codec (codecs.topk's PSEUDO_BITS, PSEUDO_DECAY; the form settled for
    `devices`, or the other one where the strategy cannot carry that) at the largest density of the
    grid whose bytes per step at `sync_every` are at most `allowed`; None if none is (or the strategy
    can carry neither form). From 3 devices the settled form is the ring-summed one, whose 2-bit sums
    need the ring's coded hops: with psum the all-gathered form, which needs only an all-gather."""
    from jaxdp.sync.codecs.topk import PSEUDO_BITS, PSEUDO_DECAY, TopK

    def at(density: float) -> Compressor:
        codec = TopK(density=density, bits=PSEUDO_BITS, decay=PSEUDO_DECAY).settled(params, devices, True)
        if abilities is not None and codec.needs not in abilities:
            codec = dataclasses.replace(codec, form="gather" if codec.form == "sum" else "sum")
        return codec

    lo, hi = 0, len(_GRID) - 1  # _GRID is descending and bytes grow with density: the first that fits
    if sent_per_step(at(_GRID[hi]), params, devices, sync_every, scalars) > allowed:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if sent_per_step(at(_GRID[mid]), params, devices, sync_every, scalars) <= allowed:
            hi = mid
        else:
            lo = mid + 1
    codec = at(_GRID[lo])
    return codec if abilities is None or codec.needs in abilities else None


def quality_key(sync_every: int, rank: int, density: float | None) -> tuple:
    """Sort key of an option, best quality first: the fewest local steps, then the least compression
    (`rank`: the option's place from none, bf16, int8, int4 to top-k; among top-k the denser); a
    top-k density below MIN_DENSITY after every other option, the densest of those first."""
    if density is not None and density < MIN_DENSITY:
        return (1, -density, sync_every, rank)
    return (0, -0.0, sync_every, rank)


def choose(params: Any, devices: int, budget: float, abilities: Collection[str] | None = None,
           momentum_free: bool = True, least_sync_every: int = 1) -> dict[str, Any]:
    """The (H, codec) `--byte-budget budget` trains with, and why: the "local_steps" record
    ({"sync_every", "pseudo_gradient", "why", "byte_budget", "bytes_per_step", "ring_bytes_per_step",
    "fewer_bytes", "options"}). `abilities`: the strategy's (jaxdp.sync.rules.abilities): int8 and
    int4 need a coded ring; `momentum_free`: the outer optimizer applies each average alone
    (controller.momentum_free), which top-k pseudo-gradients need; `least_sync_every`: the smallest H
    allowed: 2 with --metrics-at-sync, whose scalars then cross only at syncs. Raises ValueError
    when nothing fits at MAX_SYNC_EVERY."""
    scalars = least_sync_every < 2
    if not 0 < budget <= 1:
        raise ValueError(f"the byte budget must be in (0, 1], not {budget}")
    ring = ring_bytes(params, devices)
    allowed = budget * ring
    coded = abilities is None or "coded_sum" in abilities
    dense = costmodel.ladder(params, quantized_devices=devices if coded else None, devices=devices,
                             abilities=abilities)
    dense = [c for c in dense if costmodel.pseudo_gradient_codec(c)]  # none, bf16, int8, int4
    options = []  # (key, H, codec, bytes per step)
    h = max(1, least_sync_every)
    while h <= MAX_SYNC_EVERY:
        for rank, codec in enumerate(dense):
            sent = sent_per_step(codec, params, devices, h, scalars)
            if sent <= allowed:
                options.append((quality_key(h, rank, None), h, codec, sent))
        topk = densest(params, devices, h, allowed, abilities, scalars) if h >= 2 and momentum_free else None
        if topk is not None:
            options.append((quality_key(h, len(dense), topk.density), h, topk,
                            sent_per_step(topk, params, devices, h, scalars)))
        h *= 2
    if not options:
        raise ValueError(f"no choice sends at most {budget:g} of the float32 ring's bytes per step, even averaging every "
                         f"{MAX_SYNC_EVERY} steps" + ("" if momentum_free else " (top-k pseudo-gradients need an outer "
                                                      "optimizer without momentum: --outer-optimizer sgd --outer-lr 1 "
                                                      "--outer-momentum 0)"))
    options.sort(key=lambda o: o[0])
    _, h, codec, sent = options[0]
    fewer = ring / sent if sent else math.inf
    runner_up = next((o for o in options[1:] if o[1] != h or o[2].name != codec.name), None)
    why = (f"--byte-budget {budget:g}: {'synchronous' if h == 1 else f'averaged every {h} steps'}, "
           f"{'the gradient' if h == 1 else 'the pseudo-gradient'} through {codec.name}: {sent:,.0f} bytes per step "
           f"against {allowed:,.0f} allowed ({fewer:,.0f}x fewer than the float32 ring's {ring:,.0f}); of the "
           f"{len(options)} choices that fit, the fewest local steps (top-k at density {MIN_DENSITY:g} or more), then the "
           f"least compression")
    if runner_up is not None:
        why += f" (next: H = {runner_up[1]}, {runner_up[2].name})"
    if not momentum_free:
        why += ("; top-k pseudo-gradients were not offered: they need an outer optimizer without momentum "
                "(--outer-optimizer sgd --outer-lr 1 --outer-momentum 0)")
    return {"sync_every": h, "pseudo_gradient": codec.name, "why": why, "byte_budget": budget,
            "bytes_per_step": sent, "ring_bytes_per_step": ring, "allowed_bytes_per_step": allowed,
            "fewer_bytes": fewer, "codec_row": codecs.row(codec.name).name,
            "options": [{"sync_every": o[1], "codec": o[2].name, "bytes_per_step": o[3]} for o in options[:8]]}
