"""The sync choices of a run as one value, resolved once to typed values.

    spec = SyncSpec(strategy="ring", compression="powersgd:4")
    spec.validate()                 # InputError naming the first rule of jaxdp/sync/rules.py the choices break
    spec.collective, spec.codec     # the Collective and the codec (a Compressor, or None), resolved once
    spec.rule                       # "replicated" | "local" | "sharded" | "host" | "delayed" | "fsdp": the update rule
    spec.layout()                   # StateLayout: what init_state builds and the step expects

Five axes, each with one owner:

| axis | values | owner |
|---|---|---|
| strategy | a name in STRATEGIES, a `Collective`, or a bare `fn(tree, axis)` | sync/collectives.py, sync/host.py |
| compression | None, "auto", a codec name ("bf16", "int8", "powersgd:4") or a codec | sync/codecs/ (the table and one file per family) |
| sync_every, sync_fragments, outer_tx, metrics_at_sync | local steps (DiLoCo, Streaming DiLoCo) | jaxdp/step/local_sgd.py |
| shard_optimizer | ZeRO-1 | jaxdp/step/zero.py |
| overlap | every step's all-reduce overlapped with the next step (with local steps: step/rounds.py's rounds) | step/delayed.py |
| shard_params | ZeRO-3 / FSDP inside a worker (the other axes across) | step/fsdp.py, step/hsdp.py |

Which choices combine is jaxdp/sync/rules.py's table, and only there: `validate` asks it in keyword
terms, the command line (`rules.check_config`) in flag terms. Nothing here imports JAX until a
typed value is asked for (`collective`, `codec`): the command line checks its flags before JAX starts.

The controller (jaxdp/sync/controller.py) returns a new SyncSpec when it decides; a SyncSpec is
hashable, so the CLI keeps one compiled step per spec.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from jaxdp.registry import AUTO  # (older code imports it here)
from jaxdp.sync import rules
from jaxdp.sync.rules import abilities, strategy_name  # noqa: F401  (their home is rules.py; older code imports them here)

RULES = ("replicated", "local", "sharded", "host", "delayed", "fsdp")


def check_sync_every(sync_every: Any, sync_fragments: Any = 1) -> int:
    """`sync_every` as an int; ValueError unless both are positive integers (whether the fragments
    divide it is a rule of jaxdp/sync/rules.py)."""
    for name, value in (("sync_every", sync_every), ("sync_fragments", sync_fragments)):
        if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__") or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(sync_every)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """What a TrainState holds besides params, as the step compares it (a static tag of the state).

    rule:        "replicated" (also the host rule's state), "local", "sharded", "fsdp" or
                 "fsdp-local" (shard_params with local steps: jaxdp/step/hsdp.py).
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
                     "replicated": "neither local steps nor shard_optimizer", "fsdp": "shard_params=True",
                     "fsdp-local": "shard_params=True with local steps"}
            both = {self.rule, wanted.rule}
            what = "shard_optimizer" if "sharded" in both else "sync_every and outer_tx" if both in (
                {"fsdp", "fsdp-local"}, {"local", "replicated"}) else "shard_params"
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
    metrics_at_sync: bool = False  # local steps: the logged scalars averaged only at syncs (jaxdp/step/local_sgd.py)

    def replace(self, **changes: Any) -> "SyncSpec":
        return dataclasses.replace(self, **changes)

    @property
    def compressed(self) -> bool:
        """Compression is on (a codec, or "auto"); "none" and None are off."""
        return self.codec_name() is not None

    @property
    def local(self) -> bool:
        return self.sync_every == AUTO or self.sync_every > 1 or self.outer_tx is not None

    def metrics_shared(self, step: int) -> bool:
        """Whether the metrics of step `step` (steps done) are the same on every process: always, but
        with metrics_at_sync only on sync steps (every sync_every / sync_fragments; jaxdp/step/local_sgd.py)."""
        return not self.metrics_at_sync or step % (self.sync_every // self.sync_fragments) == 0

    @property
    def rule(self) -> str:
        """The update rule: "host" (an on-host strategy), "fsdp" (shard_params, every step or local
        steps), "local" (local steps), "delayed" (overlap), "sharded" (ZeRO-1) or "replicated"
        (every device applies the same update to replicated state)."""
        if "host" in self.abilities:
            return "host"
        if self.shard_params:  # every step or local steps (jaxdp/step/fsdp.py, jaxdp/step/hsdp.py)
            return "fsdp"
        if self.local:
            return "local"
        if self.overlap:
            return "delayed"
        return "sharded" if self.shard_optimizer else "replicated"

    def validate(self, **more: Any) -> "SyncSpec":
        """self, or InputError naming the first rule of jaxdp/sync/rules.py the choices break (and
        ValueError for a bad sync_every / sync_fragments). `more`: choices only the caller knows
        (`sync_seconds`, `elastic`, `float_state`: jaxdp.sync.rules.Choices)."""
        if self.sync_every != AUTO:
            check_sync_every(self.sync_every, self.sync_fragments)
        rules.check(rules.Choices.of(self, **more))
        return self

    @functools.cached_property
    def abilities(self) -> frozenset[str]:
        """What the strategy can do (jaxdp.sync.rules.abilities), asked once."""
        return abilities(self.strategy)

    @functools.cached_property
    def collective(self) -> Any:
        """The strategy as a `jaxdp.sync.collectives.Collective` (imports JAX), looked up once."""
        from jaxdp.sync.collectives import as_collective

        return as_collective(self.strategy)

    @functools.cached_property
    def codec(self) -> Any:
        """The compression as a codec (jaxdp.sync.codecs), None for none; ValueError for "auto",
        which the controller decides while training. Parsed once."""
        from jaxdp.sync.exchange import codec

        return codec(self.compression)

    def codec_name(self) -> str | None:
        """The compression as a name: None (off), "auto", or the codec's name."""
        c = self.compression
        name = None if c is None else c.strip().lower() if isinstance(c, str) else getattr(c, "name", "none")
        return None if name == "none" else name

    def layout(self) -> StateLayout:
        """The StateLayout of a state made for this spec (the host rule keeps a replicated state)."""
        rule = "replicated" if self.rule in ("host", "delayed") else self.rule  # (delayed: a slot the step adds)
        if rule == "fsdp" and self.local:  # (jaxdp/step/hsdp.py: one replica per worker)
            rule = "fsdp-local"
        codec = self.codec_name()
        if codec is not None and codec != AUTO:  # the codec's slot: None for one that keeps no state
            codec = self.codec.state_name
        return StateLayout(rule=rule, fragments=self.sync_fragments if rule in ("local", "fsdp-local") else 1,
                           compression=codec)
