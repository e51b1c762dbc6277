"""Which sync choices combine: every rule once, as data, with its message in flag terms and in keyword terms.

    choices = Choices.from_config(config)        # the command line's flags, before JAX starts
    check(choices, flags=True)                   # ConfigError in flag terms (exit 2), or nothing
    check(Choices.of(spec, elastic=True))        # InputError in keyword terms: fit, make_train_step, init_state

The choices: strategy (its abilities: jaxdp.registry.STRATEGY_ABILITIES, or asked of a user's own
collective), compression (a codec of the codec table, jaxdp/sync/codecs/__init__.py, or "auto"),
local steps (sync_every, sync_fragments, an outer optimizer), sync_seconds, ZeRO-1
(shard_optimizer), overlap, an elastic run, and whether the model keeps float state (BatchNorm).
`RULES` lists what does not combine; the first rule a set of choices breaks is the one named.
Nothing here imports JAX (a user's own strategy excepted: it is asked what it can do).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from jaxdp.errors import InputError
from jaxdp.registry import AUTO
from jaxdp.sync import codecs


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


def strategy_name(strategy: Any) -> str:
    """A strategy's name for messages: the registered name, a Collective's, or the function's."""
    if isinstance(strategy, str):
        return strategy
    return getattr(strategy, "name", None) or getattr(strategy, "__name__", "this strategy")


@dataclasses.dataclass(frozen=True)
class Choices:
    """A run's sync choices, as the rules read them."""

    strategy: str                      # its name, for messages
    abilities: frozenset[str]
    compression: str | None = None     # a codec's name, "auto", or None (none)
    needs: str = "sum"                 # what the codec needs of the collective
    sync_every: Any = 1                # an int, or "auto"
    sync_fragments: int = 1
    outer: bool = False                # an outer optimizer given: local steps even at sync_every 1
    sync_seconds: float | None = None  # workers at their own pace (jaxdp/step/rounds.py)
    shard_optimizer: bool = False
    overlap: bool = False
    elastic: bool = False
    elastic_engine: str = "hub"        # an elastic run's engine: the launcher's "hub" or "torchft" (jaxdp/elastic/ft.py)
    float_state: bool = False          # the model keeps float state (BatchNorm statistics)
    shard_params: bool = False         # ZeRO-3 / FSDP (jaxdp/step/fsdp.py)
    metrics_at_sync: bool = False      # local steps: the logged scalars averaged only at syncs (jaxdp/step/local_sgd.py)

    @property
    def local(self) -> bool:
        return self.sync_every == AUTO or self.sync_every != 1 or self.outer or self.sync_seconds is not None

    @property
    def ft(self) -> bool:
        """An elastic run on torchft: across workers its own host exchange (jaxdp/elastic/every_step.py)."""
        return self.elastic and self.elastic_engine == "torchft"

    @property
    def in_graph(self) -> bool:
        return "sum" in self.abilities and "host" not in self.abilities

    @classmethod
    def of(cls, spec: Any, **more: Any) -> "Choices":
        """The choices of a `jaxdp.sync.spec.SyncSpec`, plus those fit alone knows (`more`)."""
        name = spec.codec_name()
        return cls(strategy=strategy_name(spec.strategy), abilities=spec.abilities, compression=name,
                   needs="sum" if name in (None, AUTO) else codecs.needs(spec.compression),
                   sync_every=spec.sync_every, sync_fragments=spec.sync_fragments, outer=spec.outer_tx is not None,
                   shard_optimizer=spec.shard_optimizer, overlap=spec.overlap,
                   shard_params=getattr(spec, "shard_params", False),
                   metrics_at_sync=getattr(spec, "metrics_at_sync", False), **more)

    @classmethod
    def from_config(cls, config: Any, environ: Any = None) -> "Choices":
        """The choices a `jaxdp.config.Config` makes (ConfigError for a --compression of no codec); an
        elastic run is one that `jaxdp.launch --elastic` started (its hub's address in the environment)."""
        from jaxdp.config import ConfigError

        text = config.compression.strip().lower()
        if text not in ("none", AUTO):
            try:
                codecs.row(text)
            except ValueError:
                usage = [r.usage for r in codecs.TABLE]
                raise ConfigError(f"--compression={config.compression!r} is not {', '.join(usage[:-1])}, auto or "
                                  f"{usage[-1]} (e.g. powersgd:4)") from None
        return cls(strategy=config.strategy, abilities=abilities(config.strategy),
                   compression=None if text == "none" else text,
                   needs="sum" if text in ("none", AUTO) else codecs.row(text).needs,
                   sync_every=config.sync_every, sync_fragments=config.sync_fragments,
                   sync_seconds=config.sync_seconds or None, shard_optimizer=config.shard_optimizer,
                   overlap=config.overlap, shard_params=getattr(config, "shard_params", False),
                   metrics_at_sync=getattr(config, "metrics_at_sync", False),
                   **elastic_of(os.environ if environ is None else environ))


def elastic_of(environ: Any) -> dict[str, Any]:
    """Choices' `elastic` and `elastic_engine` of a process that `jaxdp.launch --elastic` started (its
    hub's address or its Lighthouse's in the environment)."""
    if environ.get(FT_ENV):
        return {"elastic": True, "elastic_engine": "torchft"}
    return {"elastic": bool(environ.get(ELASTIC_ENV)), "elastic_engine": "hub"}


@dataclasses.dataclass(frozen=True)
class Rule:
    """What does not combine: `when(choices)` is True for a set of choices that breaks it. `flags`
    and `words` are its message in flag terms (the command line) and in keyword terms (the library),
    formatted with the choices' fields; `setting` is the choice the message names
    (`InputError.setting`, which the command line spells as its flag)."""

    name: str
    when: Callable[[Choices], bool]
    flags: str
    words: str
    setting: str


# The codecs an elastic run on torchft codes its exchange with (jaxdp.sync.host.RowCoder): each worker's
# sum is coded once and decoded by every worker, so a codec must stand alone (no ring hops, no factors).
HOST_CODED = ("bf16", "int8", "int4")
ELASTIC_ENV = "JAXDP_ELASTIC"  # = jaxdp.elastic.hub.ENV_ADDRESS (not imported: this table imports nothing heavy)
FT_ENV = "JAXDP_FT_LIGHTHOUSE"  # = jaxdp.cluster.ft_env.ENV_LIGHTHOUSE
_ELASTIC = "an elastic run (jaxdp.launch --elastic) does not combine with "
_PACED = ": the rounds are --sync-seconds long, with one fixed --compression; drop one of them"
_OVERLAP = (": it overlaps each step's (or each --sync-every round's) all-reduce through --strategy psum or ring, with "
            "a fixed --compression (auto only with --sync-every auto), with the next step's compute; change one of them")
_NEEDS_SUM = "it needs an in-graph sum over devices"
_HOPS = ("it requantizes at every hop of a ring, and this strategy's all-reduce has no hops to requantize (XLA's "
         "all-reduce sums in full precision inside)")
_HOST_ZERO = "it averages whole gradients in host memory, so there is no device-side update to shard"
_NO_HALVES = "it has no reduce-scatter and all-gather halves (jaxdp.sync.collectives.Halves)"

RULES: tuple[Rule, ...] = (
    # -- an elastic run: across processes gradients are summed on the host (the launcher's hub,
    # jaxdp/elastic/hub.py, or torchft's process group, jaxdp/elastic/ft.py); inside a torchft
    # worker, its devices' sum may be an in-graph strategy's (psum, the ring)
    Rule("elastic-strategy", lambda c: c.elastic and "host" not in c.abilities
         and (c.elastic_engine != "torchft" or "sum" not in c.abilities),
         "an elastic run (jaxdp.launch --elastic) sums gradients on the host across processes: use --strategy host "
         "(with --elastic-engine torchft also psum or ring), not --strategy={strategy}",
         "an elastic run (jaxdp.launch --elastic) sums gradients on the host across processes: use strategy='host' "
         "(on torchft also 'psum' or 'ring'), not {strategy!r}", "strategy"),
    Rule("elastic-compression", lambda c: c.elastic and c.compression is not None and not c.ft,
         _ELASTIC + "--compression={compression} (with --elastic-engine torchft: bf16, int8 or int4)",
         _ELASTIC + "compression={compression!r} (on torchft: bf16, int8 or int4)", "compression"),
    Rule("elastic-ft-codec", lambda c: c.elastic and c.compression is not None and (
        c.compression == AUTO or codecs.row(c.compression).name not in HOST_CODED),
         "an elastic run on torchft codes each worker's sum once, as bytes every worker decodes: use --compression "
         "bf16, int8 or int4, not --compression={compression}",
         "an elastic run on torchft codes each worker's sum once, as bytes every worker decodes: use compression "
         "'bf16', 'int8' or 'int4', not {compression!r}", "compression"),
    Rule("elastic-local", lambda c: c.elastic and c.sync_every != 1 and not c.ft,
         _ELASTIC + "--sync-every={sync_every} on the launcher's hub (with --elastic-engine torchft it does)",
         _ELASTIC + "sync_every={sync_every!r} on the launcher's hub (on torchft it does)", "sync_every"),
    # -- local steps across torchft workers (jaxdp/elastic/rounds.py): rounds of a fixed H
    Rule("elastic-ft-auto", lambda c: c.ft and c.sync_every == AUTO,
         "an elastic run on torchft needs a number of local steps: --sync-every N, not auto",
         "an elastic run on torchft needs a number of local steps: sync_every=N, not 'auto'", "sync_every"),
    Rule("elastic-ft-local-state", lambda c: c.ft and c.sync_every != 1 and c.float_state,
         "an elastic run on torchft keeps no float model state across local steps (BatchNorm statistics would "
         "differ per worker): use a model without it, or --sync-every 1",
         "an elastic run on torchft keeps no float model state across local steps (BatchNorm statistics would "
         "differ per worker): use a model without it, or sync_every=1", "sync_every"),
    Rule("elastic-paced", lambda c: c.elastic and c.sync_seconds is not None and not c.ft,
         _ELASTIC + "--sync-seconds on the launcher's hub (with --elastic-engine torchft it does)",
         _ELASTIC + "sync_seconds on the launcher's hub (on torchft it does)", "sync_seconds"),
    Rule("elastic-fragments", lambda c: c.elastic and c.sync_fragments != 1,
         _ELASTIC + "--sync-fragments={sync_fragments}", _ELASTIC + "sync_fragments={sync_fragments}", "sync_fragments"),
    Rule("elastic-zero", lambda c: c.elastic and c.shard_optimizer,
         _ELASTIC + "--shard-optimizer", _ELASTIC + "shard_optimizer (ZeRO-1)", "shard_optimizer"),
    Rule("elastic-overlap", lambda c: c.elastic and c.overlap and not (c.ft and c.sync_every != 1),
         _ELASTIC + "every-step --overlap (with --elastic-engine torchft it overlaps rounds: --sync-every N --overlap)",
         _ELASTIC + "every-step overlap (with torchft it overlaps rounds: sync_every N)", "overlap"),
    # -- sync_seconds: rounds of wall-clock time (jaxdp/step/rounds.py)
    Rule("paced-local", lambda c: c.sync_seconds is not None and c.sync_every != 1,
         "--sync-seconds does not combine with --sync-every={sync_every}" + _PACED,
         "sync_seconds does not combine with sync_every={sync_every!r}: the round is sync_seconds long, not H steps",
         "sync_every"),
    Rule("paced-auto", lambda c: c.sync_seconds is not None and c.compression == AUTO,
         "--sync-seconds does not combine with --compression=auto" + _PACED,
         "sync_seconds does not combine with compression auto: choose one (none, bf16, int8, ...)", "compression"),
    Rule("paced-fragments", lambda c: c.sync_seconds is not None and c.sync_fragments != 1,
         "--sync-seconds does not combine with --sync-fragments={sync_fragments}" + _PACED,
         "sync_seconds does not combine with sync_fragments={sync_fragments}", "sync_fragments"),
    Rule("paced-zero", lambda c: c.sync_seconds is not None and c.shard_optimizer,
         "--sync-seconds does not combine with --shard-optimizer=true" + _PACED,
         "sync_seconds does not combine with shard_optimizer (ZeRO-1)", "shard_optimizer"),
    Rule("paced-strategy", lambda c: c.sync_seconds is not None and not c.in_graph,
         "--sync-seconds needs an in-graph strategy (--strategy psum or ring): --strategy={strategy} does not qualify",
         "sync_seconds needs an in-graph strategy (psum or ring), not {strategy}", "strategy"),
    Rule("paced-model-state", lambda c: c.sync_seconds is not None and c.float_state,
         "--sync-seconds keeps no model state between syncs (BatchNorm statistics would differ per process); use a "
         "model without float model state, or --sync-every",
         "sync_seconds keeps no model state between syncs (BatchNorm statistics would differ per process); use a "
         "model without float model state, or sync_every", "sync_seconds"),
    # -- overlap: each step's all-reduce (jaxdp/step/delayed.py) or each round's (jaxdp/step/rounds.py) hidden
    Rule("overlap-paced", lambda c: c.overlap and c.sync_seconds is not None,
         "--overlap does not combine with --sync-seconds={sync_seconds}" + _OVERLAP,
         "overlap does not combine with sync_seconds yet: its rounds are H steps (sync_every)", "overlap"),
    Rule("overlap-auto", lambda c: c.overlap and c.compression == AUTO and c.sync_every != AUTO,
         "--overlap does not combine with --compression=auto" + _OVERLAP,
         "overlap does not combine with compression auto: the controller measures synchronous steps; choose a codec "
         "(none, bf16, int8, ...), or sync_every auto", "compression"),
    Rule("overlap-fragments", lambda c: c.overlap and c.sync_fragments != 1,
         "--overlap does not combine with --sync-fragments={sync_fragments}" + _OVERLAP,
         "overlap does not combine with sync_fragments={sync_fragments}", "sync_fragments"),
    Rule("overlap-zero", lambda c: c.overlap and c.shard_optimizer,
         "--overlap does not combine with --shard-optimizer=true" + _OVERLAP,
         "overlap and shard_optimizer do not combine: overlap applies each averaged gradient whole, one step late; "
         "use one of them", "shard_optimizer"),
    Rule("overlap-strategy", lambda c: c.overlap and not c.in_graph,
         "--overlap does not combine with --strategy={strategy}" + _OVERLAP,
         "overlap does not apply to strategy {strategy!r}: it overlaps an in-graph all-reduce with the next step's "
         "compute; use psum or ring", "strategy"),
    Rule("overlap-model-state", lambda c: c.overlap and c.float_state,
         "--overlap keeps no float model state (BatchNorm statistics would be stale and differ per device); use a "
         "model without it",
         "overlap keeps no float model state (BatchNorm statistics would be stale and differ per device); use a "
         "model without it", "overlap"),
    # -- what each feature needs of the strategy, and ZeRO-1 (the strategy's abilities: jaxdp/sync/collectives.py)
    Rule("compression-strategy", lambda c: c.compression is not None and "sum" not in c.abilities and not c.ft,
         "--compression needs an in-graph strategy (--strategy psum or ring): --strategy={strategy} does not qualify "
         f"({_NEEDS_SUM})",
         f"compression does not apply to strategy {{strategy!r}}: {_NEEDS_SUM}; use psum or ring", "strategy"),
    Rule("topk-hops", lambda c: (c.compression or "").startswith("topk") and c.needs == "coded_sum"
         and c.needs not in c.abilities and "halves" in c.abilities and not c.ft,
         f"--compression={{compression}} needs --strategy ring ({_HOPS}); with --strategy={{strategy}} name the "
         "all-gathered form instead, :gather after BITS (topk:DENSITY:BITS:gather[:decay=B]: each device's own top-k)",
         f"compression {{compression!r}} does not apply to strategy {{strategy!r}}: {_HOPS}; use ring, or the all-gathered "
         "form, ':gather' after BITS ('topk:DENSITY:BITS:gather[:decay=B]')", "strategy"),
    Rule("compression-hops", lambda c: c.compression is not None and c.needs not in c.abilities and not c.ft,
         f"--compression={{compression}} needs --strategy ring: --strategy={{strategy}} does not qualify ({_HOPS})",
         f"compression does not apply to strategy {{strategy!r}}: {_HOPS}; use ring", "strategy"),
    Rule("local-strategy", lambda c: c.local and "sum" not in c.abilities,
         f"--sync-every needs an in-graph strategy (--strategy psum or ring): --strategy={{strategy}} does not qualify "
         f"({_NEEDS_SUM})",
         f"local steps (sync_every) does not apply to strategy {{strategy!r}}: {_NEEDS_SUM}; use psum or ring", "strategy"),
    Rule("compression-zero", lambda c: c.compression is not None and c.shard_optimizer,
         "--compression and --shard-optimizer do not combine: compression needs the whole averaged gradient on every "
         "device; use one of them",
         "compression and shard_optimizer do not combine: compression needs the whole averaged gradient on every "
         "device; use one of them", "shard_optimizer"),
    Rule("local-zero", lambda c: c.local and c.shard_optimizer,
         "--sync-every and --shard-optimizer do not combine: every device keeps its own whole inner optimizer state; "
         "use one of them",
         "local steps (sync_every) and shard_optimizer do not combine: every device keeps its own whole inner "
         "optimizer state; use one of them", "shard_optimizer"),
    Rule("zero-host", lambda c: c.shard_optimizer and "halves" not in c.abilities and "host" in c.abilities,
         f"--shard-optimizer needs an in-graph strategy (--strategy psum or ring): --strategy={{strategy}} does not "
         f"qualify ({_HOST_ZERO})",
         f"shard_optimizer does not apply to strategy {{strategy!r}}: {_HOST_ZERO}; use psum or ring", "strategy"),
    Rule("zero-halves", lambda c: c.shard_optimizer and "halves" not in c.abilities,
         f"--shard-optimizer needs an in-graph strategy (--strategy psum or ring): --strategy={{strategy}} does not "
         f"qualify ({_NO_HALVES})",
         f"shard_optimizer does not apply to strategy {{strategy!r}}: {_NO_HALVES}; use psum or ring", "strategy"),
    # -- shard_params (ZeRO-3 / FSDP inside a worker, jaxdp/step/fsdp.py; across workers jaxdp/step/hsdp.py)
    Rule("params-zero", lambda c: c.shard_params and c.shard_optimizer,
         "--shard-params does not combine with --shard-optimizer: shard_params already shards the optimizer state "
         "(it includes ZeRO-1); drop one of them",
         "shard_params does not combine with shard_optimizer: shard_params already shards the optimizer state (it "
         "includes ZeRO-1); drop one of them", "shard_optimizer"),
    Rule("params-strategy", lambda c: c.shard_params and not c.in_graph,
         "--shard-params does not combine with --strategy={strategy}: the sharded step is one XLA program, so the "
         "strategy across processes must be in-graph (psum or ring); drop one of them",
         "shard_params does not combine with strategy {strategy!r}: the sharded step is one XLA program, so the "
         "strategy across workers must be in-graph (psum or ring)", "strategy"),
    Rule("params-compression", lambda c: c.shard_params and c.compression is not None and (
        c.compression == AUTO or codecs.row(c.compression).name == "topk"),
         "--shard-params does not combine with --compression={compression}: each device holds a slice of every "
         "leaf, and top-k chooses its indices over whole ones (auto may choose it); use bf16, int8, int4 or "
         "powersgd",
         "shard_params does not combine with compression {compression!r}: each device holds a slice of every "
         "leaf, and top-k chooses its indices over whole ones (auto may choose it); use bf16, int8, int4 or "
         "powersgd", "compression"),
    Rule("params-paced", lambda c: c.shard_params and c.sync_seconds is not None,
         "--shard-params does not combine with --sync-seconds: every device keeps whole parameters in its rounds of "
         "local steps; drop one of them",
         "shard_params does not combine with sync_seconds: every device keeps whole parameters in its rounds of "
         "local steps", "sync_seconds"),
    Rule("params-local", lambda c: c.shard_params and c.sync_every == AUTO,
         "--shard-params with local steps needs a fixed --sync-every N, not auto (its measurement times the "
         "replicated step); pass --sync-every N",
         "shard_params with local steps needs a fixed sync_every, not auto (its measurement times the replicated "
         "step)", "sync_every"),
    Rule("params-overlap", lambda c: c.shard_params and c.overlap and not c.local,
         "--shard-params does not combine with every-step --overlap: it applies each whole averaged gradient one "
         "step late; overlap rounds of local steps instead (--sync-every N --overlap)",
         "shard_params does not combine with every-step overlap: it applies each whole averaged gradient one step "
         "late; overlap rounds of local steps instead (sync_every N)", "overlap"),
    # -- the logged scalars averaged only at syncs (jaxdp/step/local_sgd.py)
    Rule("metrics-local", lambda c: c.metrics_at_sync and (not c.local or c.sync_every == AUTO
                                                           or c.sync_seconds is not None),
         "--metrics-at-sync needs local steps with a fixed --sync-every N (no --sync-seconds): between syncs nothing "
         "else crosses the link",
         "metrics_at_sync needs local steps with a fixed sync_every (no sync_seconds)", "metrics_at_sync"),
    Rule("metrics-others", lambda c: c.metrics_at_sync and (c.overlap or c.compression == AUTO or (
        c.elastic and not (c.ft and c.sync_every != 1))),  # (local steps on torchft: at rounds' ends, always)
         "--metrics-at-sync does not combine with --overlap, --compression auto or an elastic run (each reads or "
         "sends the averaged scalars every step); drop one of them",
         "metrics_at_sync does not combine with overlap, compression 'auto' or an elastic run (each reads or sends "
         "the averaged scalars every step)", "metrics_at_sync"),
    Rule("metrics-state", lambda c: c.metrics_at_sync and c.float_state,
         "--metrics-at-sync does not combine with a model that keeps float state (BatchNorm statistics): they are "
         "averaged over devices every step; drop --metrics-at-sync",
         "metrics_at_sync does not combine with a model that keeps float state (BatchNorm statistics): they are "
         "averaged over devices every step", "metrics_at_sync"),
    # -- Streaming DiLoCo's fragments (jaxdp/step/local_sgd.py)
    Rule("fragments-auto", lambda c: c.sync_every == AUTO and c.sync_fragments > 1,
         "--sync-fragments={sync_fragments} needs a fixed --sync-every that it divides, not auto (which may choose 1, "
         "synchronous training); pass --sync-every N",
         "sync_fragments={sync_fragments} needs a fixed sync_every that it divides, not auto (which may choose 1, "
         "synchronous training); pass sync_every N", "sync_fragments"),
    Rule("fragments-divide", lambda c: isinstance(c.sync_every, int) and c.sync_every >= 1 and c.sync_fragments >= 1
         and c.sync_every % c.sync_fragments != 0,
         "--sync-fragments={sync_fragments} must be a positive integer that divides --sync-every={sync_every}",
         "sync_fragments={sync_fragments} must divide sync_every={sync_every}: each fragment is synchronised every "
         "sync_every steps, one every sync_every / sync_fragments steps", "sync_fragments"),
)


def broken(choices: Choices) -> Rule | None:
    """The first rule `choices` break, or None if they combine."""
    return next((rule for rule in RULES if rule.when(choices)), None)


def check(choices: Choices, flags: bool = False) -> Choices:
    """`choices`, or the first rule they break raised: InputError in keyword terms, or with `flags`
    a `jaxdp.config.ConfigError` in flag terms (one line, exit 2 on the command line)."""
    rule = broken(choices)
    if rule is None:
        return choices
    fields = {f.name: getattr(choices, f.name) for f in dataclasses.fields(choices)}
    if flags:
        from jaxdp.config import ConfigError

        raise ConfigError(rule.flags.format(**fields))
    raise InputError(rule.words.format(**fields), setting=rule.setting if rule.setting != "strategy" else None,
                     argument="strategy" if rule.setting == "strategy" else None)


def check_config(config: Any) -> Any:
    """The command line's sync choices against the rules, before JAX starts: `config`, or
    ConfigError in flag terms (jaxdp.train calls it first thing)."""
    check(Choices.from_config(config), flags=True)
    return config
