"""Which sync choices combine: every rule once, as data, with one message said in flag terms or in keyword terms.

    choices = Choices.from_config(config)        # the command line's flags, before JAX starts
    check(choices, flags=True)                   # ConfigError in flag terms (exit 2), or nothing
    check(Choices.of(spec, elastic=True))        # InputError in keyword terms: fit, make_train_step, init_state

The choices: strategy (its abilities: jaxdp.registry.STRATEGY_ABILITIES, or asked of a user's own
collective), compression (a codec of the codec table, jaxdp/sync/codecs/__init__.py, or "auto"),
local steps (sync_every, sync_fragments, an outer optimizer), sync_seconds, ZeRO-1
(shard_optimizer), overlap, an elastic run, and whether the model keeps float state (BatchNorm).
`RULES` lists what does not combine; the first rule a set of choices breaks is the one named.
Nothing here imports JAX (a user's own strategy excepted: it is asked what it can do).

Each rule's message is one template, said in flag terms (the command line) or in keyword terms (the
library): a placeholder names a field of `Choices`, and `render` spells it either way,

    {sync_every:opt}        --sync-every             sync_every              the choice
    {sync_every:is}         --sync-every=8           sync_every=8            the choice with this run's value
    {shard_optimizer:is}    --shard-optimizer=true   shard_optimizer=True
    {strategy=ring}         --strategy ring          strategy='ring'         a value to pass (a number, or N: bare)

a flag being its field's name with dashes (shard_params: --shard-params). So a
template spells no flag and no keyword itself (tests/test_sync_tables.py checks every rule both ways).
"""

from __future__ import annotations

import dataclasses
import os
import re
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
    float_state: bool = False          # the model keeps float state (BatchNorm statistics)
    shard_params: bool = False         # ZeRO-3 / FSDP (jaxdp/step/fsdp.py)
    metrics_at_sync: bool = False      # local steps: the logged scalars averaged only at syncs (jaxdp/step/local_sgd.py)
    byte_budget: Any = None            # --byte-budget: H and codec from a cap on bytes (jaxdp/sync/budget.py)

    @property
    def local(self) -> bool:
        return self.sync_every == AUTO or self.sync_every != 1 or self.outer or self.sync_seconds is not None

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
                raise ConfigError(codecs.refusal(config.compression)) from None
        return cls(strategy=config.strategy, abilities=abilities(config.strategy),
                   compression=None if text == "none" else text,
                   needs="sum" if text in ("none", AUTO) else codecs.row(text).needs,
                   sync_every=config.sync_every, sync_fragments=config.sync_fragments,
                   sync_seconds=config.sync_seconds or None, shard_optimizer=config.shard_optimizer,
                   overlap=config.overlap, shard_params=getattr(config, "shard_params", False),
                   metrics_at_sync=getattr(config, "metrics_at_sync", False),
                   byte_budget=getattr(config, "byte_budget", None), **elastic_of(os.environ if environ is None else environ))


def elastic_of(environ: Any) -> dict[str, Any]:
    """Choices' `elastic` of a process that `jaxdp.launch --elastic` started (its hub's address or its
    Lighthouse's in the environment). The rules are the same on either engine."""
    return {"elastic": bool(environ.get(ELASTIC_ENV) or environ.get(FT_ENV))}


@dataclasses.dataclass(frozen=True)
class Rule:
    """What does not combine: `when(choices)` is True for a set of choices that breaks it. `says`
    is its message, one template for both terms (the placeholders: the module's docstring);
    `setting` is the choice the message names (`InputError.setting`, which the command line spells
    as its flag)."""

    name: str
    when: Callable[[Choices], bool]
    says: str
    setting: str


PLACEHOLDER = re.compile(r"\{(\w+)(:opt|:is|=[^{}]*)\}")  # {field:opt}, {field:is}, {field=VALUE}


def render(template: str, choices: Choices, flags: bool = False) -> str:
    """`template` with its placeholders said in flag terms (`flags`) or in keyword terms."""
    def term(match: re.Match) -> str:
        name, form = match.groups()
        option = "--" + name.replace("_", "-") if flags else name
        if form == ":opt":
            return option
        if form == ":is":  # this run's value, as the command line types it or as Python writes it
            value = getattr(choices, name)
            if flags:
                return f"{option}={str(value).lower() if isinstance(value, bool) else value}"
            return f"{name}={value!r}"
        value = form[1:]  # a value to pass: a word is a string to a keyword, a number or a metavariable (N) is not
        if flags:
            return f"{option} {value}"
        return f"{name}={value if value.isdigit() or value.isupper() else repr(value)}"

    return PLACEHOLDER.sub(term, template)


# The codecs an elastic run codes its exchange with (jaxdp.elastic.rows.RowCoder): each worker's
# sum is coded once and decoded by every worker, so a codec must stand alone (no ring hops, no factors).
HOST_CODED = ("bf16", "int8", "int4")
ELASTIC_ENV = "JAXDP_ELASTIC"  # = jaxdp.elastic.hub.ENV_ADDRESS (not imported: this table imports nothing heavy)
FT_ENV = "JAXDP_FT_LIGHTHOUSE"  # = jaxdp.cluster.ft_env.ENV_LIGHTHOUSE
_ELASTIC = "an elastic run (jaxdp.launch --elastic) does not combine with "
_PACED = (": the rounds are {sync_seconds:opt} long (not H steps), with one fixed {compression:opt} (none, bf16, int8, "
          "...); drop one of them")
_OVERLAP = (": it overlaps each step's (or each {sync_every:opt} round's) all-reduce through {strategy:opt} psum or "
            "ring, with a fixed {compression:opt} (auto only with {sync_every=auto}), with the next step's compute; "
            "change one of them")
_IN_GRAPH = " needs an in-graph strategy ({strategy:opt} psum or ring): {strategy:is} does not qualify"
_NEEDS_SUM = "it needs an in-graph sum over devices"
_HOPS = ("it requantizes at every hop of a ring, and this strategy's all-reduce has no hops to requantize (XLA's "
         "all-reduce sums in full precision inside)")
_HOST_ZERO = "it averages whole gradients in host memory, so there is no device-side update to shard"
_NO_HALVES = "it has no reduce-scatter and all-gather halves (jaxdp.sync.collectives.Halves)"

RULES: tuple[Rule, ...] = (
    # -- an elastic run: across processes each worker's sums cross as bytes (jaxdp/elastic/every_step.py,
    # on either engine: the launcher's hub or torchft); inside a worker, its devices' sum may be an
    # in-graph strategy's (psum, the ring), and its state may be cut over its devices (--shard-params)
    Rule("elastic-params", lambda c: c.elastic and c.shard_params and c.local,
         "{shard_params:opt} in an elastic run needs every-step training (each worker's state cut over its own "
         "devices, the workers' rows exchanged every step; local steps and rounds keep whole replicas): drop "
         "{sync_every:opt}, {sync_seconds:opt} and {overlap:opt}, or {shard_params:opt}", "shard_params"),
    Rule("elastic-strategy", lambda c: c.elastic and "host" not in c.abilities and "sum" not in c.abilities,
         "an elastic run (jaxdp.launch --elastic) sums each worker's devices with {strategy=host}, psum or ring, "
         "not {strategy:is}", "strategy"),
    Rule("elastic-codec", lambda c: c.elastic and c.compression is not None and (
        c.compression == AUTO or codecs.row(c.compression).name not in HOST_CODED),
         "an elastic run codes each worker's sum once, as bytes every worker decodes: use {compression:opt} "
         "bf16, int8 or int4, not {compression:is}", "compression"),
    # -- local steps across elastic workers (jaxdp/elastic/rounds.py): rounds of a fixed H
    Rule("elastic-auto", lambda c: c.elastic and c.sync_every == AUTO,
         "an elastic run needs a number of local steps: {sync_every=N}, not auto", "sync_every"),
    Rule("elastic-local-state", lambda c: c.elastic and c.sync_every != 1 and c.float_state,
         "an elastic run keeps no float model state across local steps (BatchNorm statistics would "
         "differ per worker): use a model without it, or {sync_every=1}", "sync_every"),
    Rule("elastic-fragments", lambda c: c.elastic and c.sync_fragments != 1,
         _ELASTIC + "{sync_fragments:is}", "sync_fragments"),
    Rule("elastic-zero", lambda c: c.elastic and c.shard_optimizer,
         _ELASTIC + "{shard_optimizer:opt} (ZeRO-1)", "shard_optimizer"),
    Rule("elastic-overlap", lambda c: c.elastic and c.overlap and c.sync_every == 1,
         _ELASTIC + "every-step {overlap:opt} (it overlaps rounds: {sync_every=N} and {overlap:opt})", "overlap"),
    # -- sync_seconds: rounds of wall-clock time (jaxdp/step/rounds.py)
    Rule("paced-local", lambda c: c.sync_seconds is not None and c.sync_every != 1,
         "{sync_seconds:opt} does not combine with {sync_every:is}" + _PACED, "sync_every"),
    Rule("paced-auto", lambda c: c.sync_seconds is not None and c.compression == AUTO,
         "{sync_seconds:opt} does not combine with {compression:is}" + _PACED, "compression"),
    Rule("paced-fragments", lambda c: c.sync_seconds is not None and c.sync_fragments != 1,
         "{sync_seconds:opt} does not combine with {sync_fragments:is}" + _PACED, "sync_fragments"),
    Rule("paced-zero", lambda c: c.sync_seconds is not None and c.shard_optimizer,
         "{sync_seconds:opt} does not combine with {shard_optimizer:is} (ZeRO-1)" + _PACED, "shard_optimizer"),
    Rule("paced-strategy", lambda c: c.sync_seconds is not None and not c.in_graph,
         "{sync_seconds:opt}" + _IN_GRAPH, "strategy"),
    Rule("paced-model-state", lambda c: c.sync_seconds is not None and c.float_state,
         "{sync_seconds:opt} keeps no model state between syncs (BatchNorm statistics would differ per process); use a "
         "model without float model state, or {sync_every:opt}", "sync_seconds"),
    # -- overlap: each step's all-reduce (jaxdp/step/delayed.py) or each round's (jaxdp/step/rounds.py) hidden
    Rule("overlap-paced", lambda c: c.overlap and c.sync_seconds is not None,
         "{overlap:opt} does not combine with {sync_seconds:is}" + _OVERLAP, "overlap"),
    Rule("overlap-auto", lambda c: c.overlap and c.compression == AUTO and c.sync_every != AUTO,
         "{overlap:opt} does not combine with {compression:is} (the controller measures synchronous steps)" + _OVERLAP,
         "compression"),
    Rule("overlap-fragments", lambda c: c.overlap and c.sync_fragments != 1,
         "{overlap:opt} does not combine with {sync_fragments:is}" + _OVERLAP, "sync_fragments"),
    Rule("overlap-zero", lambda c: c.overlap and c.shard_optimizer,
         "{overlap:opt} does not combine with {shard_optimizer:is} (it applies each averaged gradient whole, one step "
         "late)" + _OVERLAP, "shard_optimizer"),
    Rule("overlap-strategy", lambda c: c.overlap and not c.in_graph,
         "{overlap:opt} does not combine with {strategy:is}" + _OVERLAP, "strategy"),
    Rule("overlap-model-state", lambda c: c.overlap and c.float_state,
         "{overlap:opt} keeps no float model state (BatchNorm statistics would be stale and differ per device); use a "
         "model without it", "overlap"),
    # -- what each feature needs of the strategy, and ZeRO-1 (the strategy's abilities: jaxdp/sync/collectives.py)
    Rule("compression-strategy", lambda c: c.compression is not None and "sum" not in c.abilities and not c.elastic,
         "{compression:opt}" + _IN_GRAPH + f" ({_NEEDS_SUM})", "strategy"),
    Rule("topk-hops", lambda c: (c.compression or "").startswith("topk") and c.needs == "coded_sum"
         and c.needs not in c.abilities and "halves" in c.abilities and not c.elastic,
         f"{{compression:is}} needs {{strategy=ring}} ({_HOPS}); with {{strategy:is}} name the all-gathered form "
         "instead, :gather after BITS (topk:DENSITY:BITS:gather[:decay=B]: each device's own top-k)", "strategy"),
    Rule("compression-hops", lambda c: c.compression is not None and c.needs not in c.abilities and not c.elastic,
         f"{{compression:is}} needs {{strategy=ring}}: {{strategy:is}} does not qualify ({_HOPS})", "strategy"),
    Rule("local-strategy", lambda c: c.local and "sum" not in c.abilities,
         "{sync_every:opt}" + _IN_GRAPH + f" ({_NEEDS_SUM})", "strategy"),
    Rule("compression-zero", lambda c: c.compression is not None and c.shard_optimizer,
         "{compression:opt} and {shard_optimizer:opt} do not combine: compression needs the whole averaged gradient on "
         "every device; use one of them", "shard_optimizer"),
    Rule("local-zero", lambda c: c.local and c.shard_optimizer,
         "{sync_every:opt} and {shard_optimizer:opt} do not combine: every device keeps its own whole inner optimizer "
         "state; use one of them", "shard_optimizer"),
    Rule("zero-host", lambda c: c.shard_optimizer and "halves" not in c.abilities and "host" in c.abilities,
         "{shard_optimizer:opt}" + _IN_GRAPH + f" ({_HOST_ZERO})", "strategy"),
    Rule("zero-halves", lambda c: c.shard_optimizer and "halves" not in c.abilities,
         "{shard_optimizer:opt}" + _IN_GRAPH + f" ({_NO_HALVES})", "strategy"),
    # -- shard_params (ZeRO-3 / FSDP inside a worker, jaxdp/step/fsdp.py; across workers jaxdp/step/hsdp.py)
    Rule("params-zero", lambda c: c.shard_params and c.shard_optimizer,
         "{shard_params:opt} does not combine with {shard_optimizer:opt}: {shard_params:opt} already shards the "
         "optimizer state (it includes ZeRO-1); drop one of them", "shard_optimizer"),
    Rule("params-strategy", lambda c: c.shard_params and not c.in_graph,
         "{shard_params:opt} does not combine with {strategy:is}: the sharded step is one XLA program, so the "
         "strategy across processes must be in-graph (psum or ring); drop one of them", "strategy"),
    Rule("params-compression", lambda c: c.shard_params and c.compression is not None and (
        c.compression == AUTO or codecs.row(c.compression).name == "topk"),
         "{shard_params:opt} does not combine with {compression:is}: each device holds a slice of every leaf, and "
         "top-k chooses its indices over whole ones (auto may choose it); use bf16, int8, int4 or powersgd",
         "compression"),
    Rule("params-paced", lambda c: c.shard_params and c.sync_seconds is not None,
         "{shard_params:opt} does not combine with {sync_seconds:opt}: every device keeps whole parameters in its "
         "rounds of local steps; drop one of them", "sync_seconds"),
    Rule("params-local", lambda c: c.shard_params and c.sync_every == AUTO,
         "{shard_params:opt} with local steps needs a fixed {sync_every=N}, not auto (its measurement times the "
         "replicated step)", "sync_every"),
    Rule("params-overlap", lambda c: c.shard_params and c.overlap and not c.local,
         "{shard_params:opt} does not combine with every-step {overlap:opt}: it applies each whole averaged gradient "
         "one step late; overlap rounds of local steps instead ({sync_every=N} and {overlap:opt})", "overlap"),
    # -- the logged scalars averaged only at syncs (jaxdp/step/local_sgd.py)
    Rule("budget-auto", lambda c: c.byte_budget is not None and (c.sync_every != AUTO or c.compression != AUTO),
         "{byte_budget:opt} chooses H and the codec: it needs {sync_every=auto} and {compression=auto}, not "
         "{sync_every:is} and {compression:is}", "byte_budget"),
    Rule("metrics-local", lambda c: c.metrics_at_sync and (not c.local or c.sync_every == AUTO and c.byte_budget is None
                                                           or c.sync_seconds is not None),
         "{metrics_at_sync:opt} needs local steps with a fixed {sync_every=N} or a {byte_budget:opt} (no "
         "{sync_seconds:opt}): between syncs nothing else crosses the link", "metrics_at_sync"),
    Rule("metrics-others", lambda c: c.metrics_at_sync and (c.overlap or c.compression == AUTO and c.byte_budget is None or (
        c.elastic and c.sync_every == 1)),  # (local steps of an elastic run: at rounds' ends, always)
         "{metrics_at_sync:opt} does not combine with {overlap:opt}, {compression=auto} or an elastic run (each reads "
         "or sends the averaged scalars every step); drop one of them", "metrics_at_sync"),
    Rule("metrics-state", lambda c: c.metrics_at_sync and c.float_state,
         "{metrics_at_sync:opt} does not combine with a model that keeps float state (BatchNorm statistics): they are "
         "averaged over devices every step; drop {metrics_at_sync:opt}", "metrics_at_sync"),
    # -- Streaming DiLoCo's fragments (jaxdp/step/local_sgd.py)
    Rule("fragments-auto", lambda c: c.sync_every == AUTO and c.sync_fragments > 1,
         "{sync_fragments:is} needs a fixed {sync_every:opt} that it divides, not auto (which may choose 1, "
         "synchronous training); pass {sync_every=N}", "sync_fragments"),
    Rule("fragments-divide", lambda c: isinstance(c.sync_every, int) and c.sync_every >= 1 and c.sync_fragments >= 1
         and c.sync_every % c.sync_fragments != 0,
         "{sync_fragments:is} must be a positive integer that divides {sync_every:is}: each fragment is synchronised "
         "every {sync_every:opt} steps, one every {sync_every:opt} / {sync_fragments:opt} steps", "sync_fragments"),
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
    if flags:
        from jaxdp.config import ConfigError

        raise ConfigError(render(rule.says, choices, flags=True))
    raise InputError(render(rule.says, choices), setting=rule.setting if rule.setting != "strategy" else None,
                     argument="strategy" if rule.setting == "strategy" else None)


def check_config(config: Any) -> Any:
    """The command line's sync choices against the rules, before JAX starts: `config`, or
    ConfigError in flag terms (jaxdp.train calls it first thing)."""
    check(Choices.from_config(config), flags=True)
    return config
