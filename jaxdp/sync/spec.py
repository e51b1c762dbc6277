"""The sync choices of a run as one value, and the one table of which of them combine.

    spec = SyncSpec(strategy="ring", compression="powersgd:4")
    spec.validate()                 # InputError naming the first pair of choices that do not combine
    spec.rule                       # "replicated" | "local" | "sharded" | "host" | "delayed": the update rule
    spec.layout()                   # StateLayout: what init_state builds and the step expects

Five axes, each with one owner:

| axis | values | owner |
|---|---|---|
| strategy | a name in STRATEGIES, a `Collective`, or a bare `fn(tree, axis)` | sync/collectives.py, sync/host.py |
| compression | None, "auto", a codec name ("bf16", "int8", "powersgd:4") or a `Compressor` | sync/compression.py, sync/exchange.py |
| sync_every, sync_fragments, outer_tx | local steps (DiLoCo, Streaming DiLoCo) | jaxdp/step/local_sgd.py |
| shard_optimizer | ZeRO-1 | jaxdp/step/zero.py |
| overlap | every step's all-reduce overlapped with the next step (with local steps: step/rounds.py's rounds) | step/delayed.py |
| shard_params | ZeRO-3 / FSDP: parameters, gradients, optimizer state sharded; XLA's collectives | jaxdp/step/fsdp.py |

The compatibility table (`incompatible`) is here and only here: `init_state`, `make_train_step`
and the command line's validation (jaxdp/config.py) all ask it. Nothing here imports JAX: the
command line checks its flags before JAX starts, so a built-in strategy's abilities come from
`jaxdp.registry.STRATEGY_ABILITIES`; a user's own strategy is asked (`jaxdp.sync.collectives.as_collective`).

The controller (jaxdp/sync/controller.py) returns a new SyncSpec when it decides; a SyncSpec is
hashable, so the CLI keeps one compiled step per spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxdp.errors import InputError

AUTO = "auto"  # --compression auto, --sync-every auto: decided by the controller while training

RULES = ("replicated", "local", "sharded", "host", "delayed", "fsdp")


def check_sync_every(sync_every: Any, sync_fragments: Any = 1) -> int:
    """`sync_every` as an int; ValueError unless both are positive integers and fragments divide it."""
    for name, value in (("sync_every", sync_every), ("sync_fragments", sync_fragments)):
        if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__") or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if sync_every % sync_fragments:
        raise ValueError(f"sync_fragments={sync_fragments} must divide sync_every={sync_every}: each fragment is "
                         f"synchronised every sync_every steps, one every sync_every / sync_fragments steps")
    return int(sync_every)


def abilities(strategy: Any) -> frozenset[str]:
    """What a strategy can do: a subset of {"sum", "halves", "coded_sum", "host"}."""
    from jaxdp.registry import STRATEGIES, STRATEGY_ABILITIES

    if isinstance(strategy, str) and strategy in STRATEGY_ABILITIES and strategy in STRATEGIES._paths:
        return STRATEGY_ABILITIES[strategy]
    from jaxdp.sync.collectives import as_collective

    collective = as_collective(strategy)
    return frozenset(name for name, has in (("sum", collective.sum), ("halves", collective.halves),
                                            ("coded_sum", collective.coded_sum), ("host", collective.host))
                     if has is not None)


def codec_needs(compression: Any) -> str:
    """What a codec needs of the strategy, without JAX: "coded_sum" for int8 / int4 (they requantize
    at every hop of a ring), else "sum". `compression` is a codec name or a `Compressor`."""
    if not isinstance(compression, str):
        return getattr(compression, "needs", "sum")
    return CODED_CODECS.get(compression.strip().lower(), "sum")


# The codecs whose `needs` (jaxdp.sync.compression.Compressor.needs) is not "sum", by name, for the
# command line's check before JAX starts (tests/test_quantized.py checks it against the codecs).
CODED_CODECS = {"int8": "coded_sum", "int4": "coded_sum"}


def incompatible(strategy_abilities: frozenset[str], *, compression: bool, local: bool,
                 shard_optimizer: bool, needs: str = "sum") -> tuple[str, str, str] | None:
    """The compatibility table. None if the choices combine, else (feature, culprit, why):
    `feature` is "compression", "local" or "shard_optimizer"; `culprit` is "strategy" (the
    strategy lacks what the feature needs) or "shard_optimizer" (the feature and ZeRO-1 exclude
    each other); `why` is the reason in words. `needs`: what the codec needs of the strategy
    (`codec_needs`)."""
    if compression or local:
        feature = "compression" if compression else "local"
        if "sum" not in strategy_abilities:
            return feature, "strategy", "it needs an in-graph sum over devices"
        if compression and needs not in strategy_abilities:
            return feature, "strategy", ("it requantizes at every hop of a ring, and this strategy's all-reduce has no "
                                         "hops to requantize (XLA's all-reduce sums in full precision inside)")
        if shard_optimizer:
            return feature, "shard_optimizer", (
                "compression needs the whole averaged gradient on every device" if feature == "compression"
                else "every device keeps its own whole inner optimizer state")
    if shard_optimizer and "halves" not in strategy_abilities:
        return "shard_optimizer", "strategy", (
            "it averages whole gradients in host memory, so there is no device-side update to shard"
            if "host" in strategy_abilities else "it has no reduce-scatter and all-gather halves (jaxdp.sync.collectives.Halves)")
    return None


# ---- shard_params (ZeRO-3 / FSDP, jaxdp/step/fsdp.py): what it does not combine with, yet ----------------------
SHARD_PARAMS_CLASHES = (  # (the other choice, why); the first that applies is the message
    ("shard_optimizer", "shard_params already shards the optimizer state (it includes ZeRO-1)"),
    ("strategy", "XLA inserts shard_params' all-gathers and reduce-scatters itself, so the strategy must be psum"),
    ("compression", "compression needs the whole averaged gradient on every device"),
    ("local", "local steps keep a whole replica of the parameters on every device"),
    ("overlap", "overlap applies each whole averaged gradient one step late"),
)


def shard_params_clash(strategy: Any, *, shard_optimizer: bool, compression: bool, local: bool,
                       overlap: bool) -> tuple[str, str] | None:
    """None if shard_params combines with these choices, else (the other choice, why)."""
    others = {"shard_optimizer": shard_optimizer, "strategy": strategy_name(strategy) != "psum",
              "compression": compression, "local": local, "overlap": overlap}
    return next(((name, why) for name, why in SHARD_PARAMS_CLASHES if others[name]), None)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """What a TrainState holds besides params, as the step compares it (a static tag of the state).

    rule:        "replicated" (also the host rule's state), "local" or "sharded".
    fragments:   local steps: one outer optimizer state per fragment.
    compression: what the compression slot of `state.sync` was made for: None (no slot), "auto"
                 (one slot serving every candidate), or a codec's `state_name` (PowerSGD's rank).
    """

    rule: str = "replicated"
    fragments: int = 1
    compression: str | None = None

    def serves(self, wanted: "StateLayout") -> str | None:
        """None if a state of this layout can be stepped by a step that wants `wanted`, else what
        differs, in words that say which argument to pass to both init_state and make_train_step."""
        if self.rule != wanted.rule:
            names = {"local": "local steps (sync_every > 1 or an outer_tx)", "sharded": "shard_optimizer=True",
                     "replicated": "neither local steps nor shard_optimizer", "fsdp": "shard_params=True"}
            what = "shard_optimizer" if "sharded" in (self.rule, wanted.rule) else \
                "shard_params" if "fsdp" in (self.rule, wanted.rule) else "sync_every and outer_tx"
            return (f"this state was made by init_state for {names[self.rule]} but the step for {names[wanted.rule]}; "
                    f"pass the same {what} to init_state and make_train_step")
        if self.fragments != wanted.fragments:
            return (f"this state was made with sync_fragments={self.fragments} but the step with sync_fragments="
                    f"{wanted.fragments}; pass the same to init_state and make_train_step")
        if wanted.compression is not None and self.compression not in (AUTO, wanted.compression):
            return (f"the state has no compression state for {wanted.compression} (it was made for "
                    f"{self.compression or 'no compression'}); make it with init_state(..., compression="
                    f"{wanted.compression!r}) or compression='auto'")
        return None


@dataclasses.dataclass(frozen=True)
class SyncSpec:
    """The sync choices of a step (module docstring). Hashable; build variants with `.replace`."""

    strategy: Any = "psum"
    compression: Any = None
    sync_every: Any = 1
    sync_fragments: int = 1
    outer_tx: Any = None
    shard_optimizer: bool = False
    overlap: bool = False  # every-step training: the all-reduce overlaps the next step (jaxdp/step/delayed.py)
    shard_params: bool = False  # ZeRO-3 / FSDP (jaxdp/step/fsdp.py)

    def replace(self, **changes: Any) -> "SyncSpec":
        return dataclasses.replace(self, **changes)

    @property
    def compressed(self) -> bool:
        """Compression is on (a codec, or "auto"); "none" and None are off."""
        return self.codec_name() is not None

    @property
    def local(self) -> bool:
        return self.sync_every == AUTO or self.sync_every > 1 or self.outer_tx is not None

    @property
    def rule(self) -> str:
        """The update rule: "host" (an on-host strategy), "local" (local steps), "sharded" (ZeRO-1)
        or "replicated" (every device applies the same update to replicated state)."""
        if "host" in abilities(self.strategy):
            return "host"
        if self.local:
            return "local"
        if self.overlap:
            return "delayed"
        if self.shard_params:
            return "fsdp"
        return "sharded" if self.shard_optimizer else "replicated"

    def validate(self) -> "SyncSpec":
        """self, or InputError naming the first pair of choices that do not combine (and ValueError
        for a bad sync_every / sync_fragments)."""
        if self.sync_every != AUTO:
            check_sync_every(self.sync_every, self.sync_fragments)
        if self.shard_params:
            clash = shard_params_clash(self.strategy, shard_optimizer=self.shard_optimizer, compression=self.compressed,
                                       local=self.local, overlap=self.overlap)
            if clash:
                raise InputError(f"shard_params does not combine with {clash[0]}: {clash[1]}; drop one of them",
                                 argument=clash[0] if clash[0] != "local" else "sync_every")
        needs = codec_needs(self.compression) if self.compressed else "sum"
        clash = incompatible(abilities(self.strategy), compression=self.compressed, local=self.local,
                             shard_optimizer=self.shard_optimizer, needs=needs)
        if clash:
            feature, culprit, why = clash
            name = {"compression": "compression", "local": "local steps (sync_every)",
                    "shard_optimizer": "shard_optimizer"}[feature]
            if culprit == "strategy":
                use = "ring" if feature == "compression" and needs != "sum" else "psum or ring"
                raise InputError(f"{name} does not apply to strategy {strategy_name(self.strategy)!r}: {why}; use {use}",
                                 argument="strategy")
            raise InputError(f"{name} and shard_optimizer do not combine: {why}; use one of them",
                             argument="shard_optimizer")
        if self.overlap and not self.local:  # (local steps overlap their rounds: jaxdp/step/rounds.py)
            if "host" in abilities(self.strategy) or "sum" not in abilities(self.strategy):
                raise InputError(f"overlap does not apply to strategy {strategy_name(self.strategy)!r}: it overlaps an "
                                 f"in-graph all-reduce with the next step's compute; use psum or ring",
                                 argument="strategy")
            if self.shard_optimizer:
                raise InputError("overlap and shard_optimizer do not combine: overlap applies each averaged gradient "
                                 "whole, one step late; use one of them", argument="shard_optimizer")
            if self.codec_name() == AUTO:
                raise InputError("overlap does not combine with compression auto: the controller measures "
                                 "synchronous steps; choose a codec (none, bf16, int8, ...)", argument="compression")
        return self

    def codec_name(self) -> str | None:
        """The compression as a name: None (off), "auto", or the codec's name."""
        c = self.compression
        name = None if c is None else c.strip().lower() if isinstance(c, str) else getattr(c, "name", "none")
        return None if name == "none" else name

    def layout(self) -> StateLayout:
        """The StateLayout of a state made for this spec (the host rule keeps a replicated state)."""
        rule = "replicated" if self.rule in ("host", "delayed") else self.rule  # (delayed: a slot the step adds)
        codec = self.codec_name()
        if codec is not None and codec != AUTO:  # the codec's slot: None for one that keeps no state
            from jaxdp.sync.compression import parse

            codec = (parse(codec) if isinstance(self.compression, str) else self.compression).state_name
        return StateLayout(rule=rule, fragments=self.sync_fragments if rule == "local" else 1, compression=codec)


def from_config(config: Any, outer_tx: Any = None) -> SyncSpec:
    """The SyncSpec a `jaxdp.config.Config` asks for ("auto" kept where it says auto); `outer_tx`
    is the outer optimizer, used only with local steps (the CLI's H = 1 is plain synchronous training)."""
    return SyncSpec(strategy=config.strategy, compression=None if config.compression == "none" else config.compression,
                    sync_every=config.sync_every, sync_fragments=config.sync_fragments,
                    outer_tx=None if config.sync_every == 1 else outer_tx, shard_optimizer=config.shard_optimizer,
                    shard_params=getattr(config, "shard_params", False))


def strategy_name(strategy: Any) -> str:
    """A strategy's name for messages: the registered name, a Collective's, or the function's."""
    if isinstance(strategy, str):
        return strategy
    return getattr(strategy, "name", None) or getattr(strategy, "__name__", "this strategy")
