"""Group the hazards of a compute-sanitizer racecheck log (``--racecheck-report analysis``, as
``scripts/sanitize.sh racecheck`` writes it) by kernel and source lines, and name those of Triton's
``warp_specialize`` start-up.

Every warp-specialised Gluon kernel shows hazards between accesses that the tool attributes to the
kernel's ``def`` line and to its ``gl.warp_specialize(`` call: the partitions' start-up code, which
Triton generates (docs/testing.md, "Under compute-sanitizer"; ``scripts/racecheck_probe.py`` shows them
in a kernel without data of its own). This script tells them apart from hazards on the kernel's own
buffers, which are the ones to read.

usage: python scripts/racecheck_summary.py LOG [SOURCE_DIR ...]   (default source dirs: ops/, scripts/)
Prints one line per group and a total; exit status 0.
"""
from __future__ import annotations

import os
import re
import sys
from collections import defaultdict

_ACCESS = re.compile(r"(Read|Write) access at (\S+?)(?:\+0x[0-9a-f]+)? in ([^\s:]+):(\d+)(?: \[(\d+) hazards?\])?")
_START = re.compile(r"(Error|Warning): Race reported between ")


def parse(text: str) -> list[dict]:
    """The log's records: ``{"kernel", "accesses": [(kind, file, line)], "hazards"}``."""
    records, current = [], None
    for raw in text.splitlines():
        line = raw.lstrip(". ")
        if not line.startswith("========="):
            continue
        body = line[len("========="):].strip()
        access = _ACCESS.search(body)
        if _START.match(body) and access:
            current = {"kernel": access.group(2), "accesses": [(access.group(1), access.group(3), int(access.group(4)))],
                       "hazards": 0}
            records.append(current)
        elif current is not None and body.startswith("and ") and access:
            current["accesses"].append((access.group(1), access.group(3), int(access.group(4))))
            current["hazards"] += int(access.group(5) or 1)
        elif not body:
            current = None
    return records


def _source_line(name: str, line: int, dirs: list[str], cache: dict) -> str | None:
    if name not in cache:
        cache[name] = None
        for d in dirs:
            path = os.path.join(d, name)
            if os.path.isfile(path):
                with open(path) as f:
                    cache[name] = f.read().splitlines()
                break
    lines = cache[name]
    return lines[line - 1] if lines and 0 < line <= len(lines) else None


def is_startup(record: dict, dirs: list[str], cache: dict) -> bool:
    """Every access of the record is on the kernel's ``def`` line or on a ``warp_specialize(`` call."""
    for _, name, line in record["accesses"]:
        text = _source_line(name, line, dirs, cache)
        if text is None:
            return False
        text = text.strip()
        if not (text.startswith(f"def {record['kernel']}(") or "warp_specialize(" in text):
            return False
    return True


def _quote(loc: str, dirs: list[str], cache: dict) -> str:
    name, line = loc.rsplit(":", 1)
    text = _source_line(name, int(line), dirs, cache)
    return f" ({text.strip()[:70]})" if text else ""


def summarize(text: str, dirs: list[str]) -> list[str]:
    cache: dict = {}
    groups: dict = defaultdict(lambda: [0, 0])  # (kernel, startup, accesses) -> [records, hazards]
    for rec in parse(text):
        startup = is_startup(rec, dirs, cache)
        key = (rec["kernel"], startup, tuple(sorted(set((k, f"{n}:{l}") for k, n, l in rec["accesses"]))))
        groups[key][0] += 1
        groups[key][1] += rec["hazards"]
    out, startup_n, other_n = [], 0, 0
    for (kernel, startup, accesses), (n, hazards) in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        label = "warp_specialize start-up" if startup else "kernel buffers"
        where = ", ".join(f"{k.lower()} {loc}" + ("" if startup else _quote(loc, dirs, cache)) for k, loc in accesses)
        out.append(f"  {kernel}: {n} report(s), {hazards} hazards, {label}: {where}")
        if startup:
            startup_n += n
        else:
            other_n += n
    out.append(f"racecheck reports: {startup_n + other_n}; Triton's warp_specialize start-up: {startup_n}; "
               f"on the kernels' own buffers: {other_n}")
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = argv[1:] or [os.path.join(repo, "ops"), os.path.join(repo, "scripts")]
    with open(argv[0], errors="replace") as f:
        print("\n".join(summarize(f.read(), dirs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
