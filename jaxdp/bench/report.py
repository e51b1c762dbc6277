"""Output shared by the benchmarks: sizes in binary units, the table on stdout, the JSON file
with the machine it ran on."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_size(text: str) -> int:
    """'64KB' -> 65536 (binary units)."""
    text = text.strip().upper()
    for unit in sorted(UNITS, key=len, reverse=True):
        if text.endswith(unit) and text[:-len(unit)].replace(".", "", 1).isdigit():
            return int(float(text[:-len(unit)]) * UNITS[unit])
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"size {text!r} is not like 1KB, 64KB, 1MB, 16MB")


def human(nbytes: int) -> str:
    for unit in ("GB", "MB", "KB"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit}"
    return f"{nbytes}B"


LOAD_AT_START = os.getloadavg()  # 1, 5, 15-minute load averages when this process started


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    import jax
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
            "loadavg_at_start": LOAD_AT_START, "loadavg_at_end": os.getloadavg(),
            "malloc_env": {k: os.environ.get(k) for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")},
            "command": " ".join(["python", "-m", "jaxdp.bench", *sys.argv[1:]])}


def write_json(path: str | None, results: list[dict], **extra: Any) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"results": results, "machine": machine(), **extra}, f, indent=1)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format); a key ending in "_s" with header "... ms" prints milliseconds."""
    def cell(row: dict, key: str, header: str, fmt: str) -> str:
        value = row.get(key)
        if value is None:
            return "-"
        return format(value * 1e3 if header.endswith("ms") else value, fmt)
    cells = [[cell(row, *column) for column in columns] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h, _) in enumerate(columns)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))
