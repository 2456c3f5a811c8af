"""The benchmark report: sections of rows, printed as text tables, written as
bench.json (everything) and bench.md (Markdown tables under one header line
naming the machine, platform, device, date and versions).

A section is {"id", "title", "columns": [[key, header]], "rows": [dict],
"notes": [str]}; every header names its unit.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

# every timing row says what it measured and in which unit
RATIO_COLUMNS = [("case", "case"), ("measured", "measured"), ("value", "value"),
                 ("unit", "unit")]


def section(sid: str, title: str, columns, rows, notes=()) -> dict:
    """One table of the report; `columns`: (row key, header with its unit) pairs."""
    return {"id": sid, "title": title, "columns": [list(c) for c in columns], "rows": rows,
            "notes": list(notes)}


def machine_info(mode: str, wall_s: float | None = None) -> dict:
    """Where and with what the numbers were measured."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    devices = jax.devices()
    versions = {}
    for pkg in ("jax", "jaxlib", "flax", "optax", "numpy"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"mode": mode, "machine": f"{platform.system()} {platform.machine()}, {cpu}, "
                                     f"{os.cpu_count()} cores",
            "platform": jax.default_backend(), "device_kind": devices[0].device_kind,
            "device_count": len(devices),
            "fake_devices": jax.default_backend() == "cpu" and len(devices) > 1,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
            "versions": versions, "wall_s": wall_s, "command": " ".join(sys.argv)}


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (float, np.floating)):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.1f}"
    return str(v)


def format_section(sec: dict, markdown: bool = False) -> str:
    """A section as an aligned text table (or Markdown), its notes below."""
    heads = [h for _, h in sec["columns"]]
    cells = [[_cell(r.get(k)) for k, _ in sec["columns"]] for r in sec["rows"]]
    if markdown:
        lines = [f"### {sec['title']}", "", "| " + " | ".join(heads) + " |",
                 "|" + "|".join("---" for _ in heads) + "|"]
        lines += ["| " + " | ".join(x.replace("|", "\\|") for x in c) + " |" for c in cells]
        return "\n".join(lines + [""] + [f"- {n}" for n in sec["notes"]])
    widths = [max(len(x) for x in col) for col in zip(heads, *cells)]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
    took = f" ({sec['wall_s']:.0f} s)" if sec.get("wall_s") else ""
    return "\n".join([f"== {sec['title']}{took}", fmt(heads)] + [fmt(c) for c in cells]
                     + [f"   {n}" for n in sec["notes"]])


def header(meta: dict) -> str:
    v = meta["versions"]
    return (f"{meta['machine']}; platform {meta['platform']}, {meta['device_count']} x "
            f"{meta['device_kind']}{' (fake devices)' if meta['fake_devices'] else ''}; "
            f"{meta['date']}; jax {v['jax']}, jaxlib {v['jaxlib']}, flax {v['flax']}, "
            f"optax {v['optax']}, Python {meta['python']}; mode {meta['mode']}")


def write_report(report: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """DIR/bench.json (everything) and DIR/bench.md (the tables under one header line)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    md = [f"**jaxtp benchmark** — {header(report['meta'])}", ""]
    for s in report["sections"]:
        md += [format_section(s, markdown=True), ""]
    (out / "bench.md").write_text("\n".join(md))
    return out / "bench.json", out / "bench.md"


RESULTS_PAGE = "docs/results.md"  # where the measured results are published
README_BEGIN = f"<!-- bench:begin (python -m jaxtp.bench --readme {RESULTS_PAGE} writes this) -->"
README_END = "<!-- bench:end -->"


def splice_readme(readme: str | Path, markdown: str) -> None:
    """Replace what lies between README_BEGIN and README_END in `readme` with
    `markdown` (a bench.md), so the README's results are the benchmark's output."""
    head, _, tail = readme_parts(readme)
    # bench.md's ### sections sit one level below the README section that holds them
    body = markdown.strip().replace("\n### ", "\n#### ")
    Path(readme).write_text(f"{head}{README_BEGIN}\n{body}\n{README_END}{tail}")


def readme_parts(readme: str | Path) -> tuple[str, str, str]:
    """(before the begin marker, between the markers, after the end marker)."""
    text = Path(readme).read_text()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if text.count(README_BEGIN) != 1 or text.count(README_END) != 1 or end < begin:
        raise ValueError(f"{readme} needs one line {README_BEGIN!r} and, after it, one line "
                         f"{README_END!r}, to mark where the results go")
    return text[:begin], text[begin + len(README_BEGIN):end], text[end + len(README_END):]
