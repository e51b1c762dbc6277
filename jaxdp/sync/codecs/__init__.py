"""The codecs: one table of what each is, and `parse`, which imports only the one that a spec names.

    from jaxdp.sync import codecs
    codecs.row("powersgd:4:start=10")      # its TABLE row, without JAX: grammar, needs, ladder place
    codecs.parse("powersgd:4:start=10")    # PowerSGD(rank=4, start=10), importing codecs/powersgd.py only
    codecs.ladder_rows()                   # the rows --compression auto chooses among, in ladder order

One file per family: plain.py (none, bf16), quantized.py (int8, int4), powersgd.py; base.py holds
the `Compressor` interface and the slot each codec owns in `state.sync` (its docstring). This
module imports no JAX: the sync choices are checked against the table before JAX starts
(jaxdp/sync/rules.py), and the cost model's ladder, the controller and the tests read it too.

A new codec (a top-k, say) is its file here, a class with the base's methods (`from_spec`,
`candidates` if auto may choose it, `mean`, `payload_bytes`, and `init` / `read` / `serving` if it
keeps state), plus one line in TABLE.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from typing import Any


@dataclasses.dataclass(frozen=True)
class Row:
    """One codec in the table.

    name:      its name, the spec's first word ("powersgd").
    grammar:   a regular expression of the whole spec (lower case), checked before anything is imported.
    usage:     the grammar in words, for messages.
    where:     "module:Class" that implements it (the class's `from_spec(text)` builds it).
    needs:     what it needs of the collective: "sum" (psum and the ring carry it), "coded_sum"
               (a ring whose hops it encodes: jaxdp.sync.collectives.Collective.coded_sum), or
               "halves" (its all-gather: top-k's all-gathered form).
    bytes_per_value: what one float32 value costs on the wire, scales included, for a large buffer
               (None: it depends on the shapes, as PowerSGD's factors do; the codec's `payload_bytes`).
    ladder:    its place in --compression auto's ladder (None: never chosen by auto). Place 0 is the
               floor, always offered; a candidate of a later place is left out where it moves no
               fewer bytes than the one before it, if `fewer_bytes`.
    guarded:   --compression auto's quality guard replays it before keeping it (jaxdp/sync/controller.py);
               so local steps may not send their pseudo-gradient through the ladder's own under auto
               (the guard measures gradients); top-k's pseudo-gradient form has candidates of its own,
               guarded at a threshold of their own (TopK.pseudo_candidates, costmodel.PSEUDO_GUARD_THRESHOLD).
    keeps_state: it has a slot in state.sync (error feedback, shared factors).
    example:   a spec of it, for tests and messages (default: its name).
    """

    name: str
    grammar: str
    usage: str
    where: str
    needs: str = "sum"
    bytes_per_value: float | None = None
    ladder: int | None = None
    fewer_bytes: bool = False
    guarded: bool = False
    keeps_state: bool = False
    example: str = ""

    def __post_init__(self) -> None:
        if not self.example:
            object.__setattr__(self, "example", self.name)

    def load(self) -> type:
        """The class that implements it (imports its module, and JAX)."""
        module, _, name = self.where.partition(":")
        return getattr(importlib.import_module(module), name)


_PSGD_OPTIONS = r"(:(start=\d+|min_rate=\d+(\.\d*)?|seed=\d+))*"
_FRACTION = r"0?\.\d*[1-9]\d*|1(\.0*)?"  # a number in (0, 1]
_TOPK = rf"topk:({_FRACTION})"  # DENSITY in (0, 1]
_CHUNKS = "|".join(str(2 ** i) for i in range(16, 0, -1))  # C: a power of 2 up to topk.MAX_CHUNK
_TAIL = rf"(:decay=({_FRACTION}))?(:chunk=({_CHUNKS}))?"  # B in (0, 1], then C
TOPK_USAGE = "topk:DENSITY[:BITS][:sum|:gather][:decay=B][:chunk=C]"
_QUANT_BYTES = 4 / 512  # one float32 scale per block of QUANT_BLOCK (codecs/quantized.py) values

TABLE: tuple[Row, ...] = (
    Row("none", "none", "none", "jaxdp.sync.codecs.plain:NoCompression", bytes_per_value=4.0, ladder=0),
    Row("bf16", "bf16", "bf16", "jaxdp.sync.codecs.plain:Bf16", bytes_per_value=2.0, ladder=0),
    Row("int8", "int8", "int8", "jaxdp.sync.codecs.quantized:Quantized", needs="coded_sum",
        bytes_per_value=1 + _QUANT_BYTES, ladder=1, keeps_state=True),
    Row("int4", "int4", "int4", "jaxdp.sync.codecs.quantized:Quantized", needs="coded_sum",
        bytes_per_value=0.5 + _QUANT_BYTES, ladder=1, keeps_state=True),
    Row("powersgd", r"powersgd:[1-9]\d*" + _PSGD_OPTIONS, "powersgd:RANK[:start=STEP][:min_rate=R][:seed=S]",
        "jaxdp.sync.codecs.powersgd:PowerSGD", ladder=2, fewer_bytes=True, guarded=True,
        keeps_state=True, example="powersgd:4:start=2"),
    Row("topk", _TOPK + "(:32)?(:sum)?" + _TAIL, TOPK_USAGE,
        "jaxdp.sync.codecs.topk:TopK", ladder=3, fewer_bytes=True, guarded=True, keeps_state=True,
        example="topk:0.1"),
    Row("topk", _TOPK + ":[842](:sum)?" + _TAIL, "topk:DENSITY:BITS[:sum][:decay=B][:chunk=C] (BITS 8, 4, 2: the ring)",
        "jaxdp.sync.codecs.topk:TopK", needs="coded_sum", guarded=True, keeps_state=True, example="topk:0.1:8"),
    Row("topk", _TOPK + "(:(32|8|4|2))?:gather" + _TAIL, "topk:DENSITY[:BITS]:gather[:decay=B][:chunk=C] (psum or the ring)",
        "jaxdp.sync.codecs.topk:TopK", needs="halves", guarded=True, keeps_state=True, example="topk:0.1:2:gather"),
)

_USAGES = list(dict.fromkeys(next(r.usage for r in TABLE if r.name == name) for name in dict.fromkeys(r.name for r in TABLE)))
SPEC_HELP = ", ".join(_USAGES[:-1]) + f" or {_USAGES[-1]}"


_TOPK_SLOTS = ("BITS", "sum or gather", "decay=B", "chunk=C")  # the optional parts, in the order the grammar takes them


def topk_fault(text: str) -> str | None:
    """What is wrong with a top-k spec (lower case), in a few words: its first part that is not what
    `TOPK_USAGE` allows there, and what that part may be; None where every part fits."""
    parts = text.split(":")
    if len(parts) < 2 or not parts[1]:
        return "DENSITY is missing: a fraction in (0, 1], e.g. topk:0.01"
    if not re.fullmatch(_FRACTION, parts[1]):
        return f"DENSITY {parts[1]!r} is not a decimal in (0, 1], e.g. 0.01"
    open_from = 0  # the first of _TOPK_SLOTS that may still come
    for before, part in zip(parts[1:], parts[2:]):
        if part.isdigit():
            slot = 0
            if part not in ("32", "8", "4", "2"):
                return f"BITS {part!r} is not 32, 8, 4 or 2"
        elif part in ("sum", "gather"):
            slot = 1
        elif part.startswith("decay="):
            slot = 2
            if not re.fullmatch(_FRACTION, part[6:]):
                return f"{part}: B is not in (0, 1], e.g. decay=0.98"
        elif part.startswith("chunk="):
            slot = 3
            if not re.fullmatch(_CHUNKS, part[6:]):
                return f"{part}: C is not a power of 2 up to 65536"
        else:
            return f"{part!r} is not BITS (32, 8, 4, 2), sum, gather, decay=B or chunk=C"
        if slot == open_from - 1:
            return f"{part!r} after {before!r}: name {_TOPK_SLOTS[slot]} once"
        if slot < open_from:
            return f"{part!r} after {before!r}: {_TOPK_SLOTS[slot]} comes before {_TOPK_SLOTS[open_from - 1]}"
        open_from = slot + 1
    return None


def row(spec: str) -> Row:
    """The row whose grammar `spec` matches (ValueError, one line, saying what is accepted, and for
    a top-k spec first which part is wrong and what it may be)."""
    if not isinstance(spec, str):
        raise ValueError(f"compression {spec!r}: not a string; use {SPEC_HELP}")
    text = spec.strip().lower()
    for r in TABLE:
        if re.fullmatch(r.grammar, text):
            return r
    kind = text.partition(":")[0]
    if kind == "topk" and topk_fault(text):
        raise ValueError(f"compression {spec!r}: {topk_fault(text)}; use {SPEC_HELP}")
    why = "unknown kind" if all(r.name != kind for r in TABLE) else f"it is not {next(r.usage for r in TABLE if r.name == kind)}"
    raise ValueError(f"compression {spec!r}: {why}; use {SPEC_HELP}")


def refusal(spec: str) -> str:
    """The command line's one line for a --compression that no row matches: a top-k spec's wrong
    part and what it may be, with top-k's grammar alone; else every codec's grammar."""
    fault = topk_fault(spec.strip().lower()) if spec.strip().lower().partition(":")[0] == "topk" else None
    if fault:
        return f"--compression={spec!r}: {fault} ({TOPK_USAGE}, or auto)"
    return f"--compression={spec!r} is not {', '.join(_USAGES)} or auto (e.g. powersgd:4)"


def parse(spec: str) -> Any:
    """The codec `spec` names ("none" | "bf16" | "int8" | "int4" | "powersgd:RANK[...]"), a
    `Compressor`; ValueError (one line) otherwise. Imports only the module of its row; a spec is
    parsed once per process (codecs are frozen values)."""
    found = row(spec)
    try:
        return _parsed(found, spec.strip().lower())
    except ValueError as err:
        raise ValueError(f"compression {spec!r}: {err}; use {SPEC_HELP}") from None


@functools.lru_cache(maxsize=64)
def _parsed(found: Row, text: str) -> Any:
    return found.load().from_spec(text)


def ladder_rows() -> list[Row]:
    """The rows --compression auto chooses among, from least to most compression."""
    return sorted((r for r in TABLE if r.ladder is not None), key=lambda r: r.ladder)


def needs(compression: Any) -> str:
    """What a codec (a spec or a codec object) needs of the collective, without JAX."""
    if isinstance(compression, str):
        return row(compression).needs
    return getattr(compression, "needs", "sum")


def __getattr__(attr: str) -> Any:
    """The implementing names, loaded on first use: codecs.PowerSGD, codecs.Compressor, ..."""
    homes = {"Compressor": "base", "CompressionState": "base", "Wire": "base", "bytes_sent": "base",
             "uncompressed_bytes": "base", "leaf_key": "base", "SLOT": "base", "auto_slot": "base",
             "NoCompression": "plain", "Bf16": "plain", "Quantized": "quantized", "QUANT_BLOCK": "quantized",
             "PowerSGD": "powersgd", "TopK": "topk", "orthonormalize": "powersgd", "matrix_view": "powersgd",
             "DEFAULT_MIN_RATE": "powersgd", "ORTHO_EPS": "powersgd"}
    if attr not in homes:
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    return getattr(importlib.import_module(f"{__name__}.{homes[attr]}"), attr)
