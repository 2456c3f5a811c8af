"""`collectives.svg`: where each collective of the compiled train step sits.

One transformer block drawn as a column of its modules (with the embedding
and the LM head at the ends), and beside each module the collectives the
compiled HLO holds there: forward on the left, backward on the right, one
column per impl, each marked with its Megatron role (f, g, their SP forms,
the loss's reductions), payload and bytes; a count that differs from the
budget is drawn in a warning colour. It is drawn from `comm_report.json`'s
`table` (`jaxtp.analysis.rows.table_rows`), never by hand. The SVG needs
nothing; the PNG (the same layout) needs matplotlib. The same rows as text:
`format_table`.
"""

from __future__ import annotations

from pathlib import Path
from xml.sax.saxutils import quoteattr

from ..plot import NoMatplotlib, pyplot
from .rows import ANY_SCOPE, Expected, role_text, row_cells, shape_text, size_text, table_rows

# the modules top to bottom: (slot, label)
MODULES = (("embedding", "embedding (vocab-parallel), positions"),
           ("norm", "norms (two per block, the final one)"),
           ("attn_in", "attention q / kv (column-parallel)"),
           ("attn_core", "attention core (heads split over tp)"),
           ("attn_out", "attention out (row-parallel)"),
           ("mlp_up", "MLP up (column-parallel)"),
           ("mlp_down", "MLP down (row-parallel)"),
           ("head", "LM head (vocab-parallel)"),
           ("loss", "cross-entropy (vocab-parallel)"),
           ("grads", "gradients: global norm, dp sum"))
BLOCK = ("norm", "attn_in", "attn_core", "attn_out", "mlp_up", "mlp_down")
OK, WARN, INK, BOX = "#1f4e79", "#c0392b", "#222222", "#eef3f8"
LINE, FONT, PAD, MODULE_W, COLUMN_W, TOP = 14, 11, 6, 300, 310, 64


def slot(row: dict) -> str:
    """The module a collective belongs to, from its scope and budget role."""
    role, scope = role_text(row), row["scope"]
    if scope in ("attention", "mlp"):
        entry, exit_ = ("attn_in", "attn_out") if scope == "attention" else ("mlp_up", "mlp_down")
        if role.startswith("kv gradient"):
            return "attn_core"
        if role.startswith(("g", "SP exit")) or "bias" in role:
            return exit_  # g, g_sp and its ring, the row-parallel bias
        return entry  # f, f_sp and its ring, a remat's regather, the kv weight
    if scope == "embed":
        return "embedding"
    if scope == "cross_entropy":
        return "loss" if role.startswith("cross-entropy") else "head"
    if role.startswith("norm weights"):
        return "norm"
    return "embedding" if role.startswith("learned positions") else "grads"


def _fit(text: str) -> str:
    """`text` cut to what a column holds (monospace, about 0.6 em a character)."""
    chars = int((COLUMN_W - 8) / (0.6 * (FONT - 1)))
    return text if len(text) <= chars else text[: chars - 3] + "..."


def layout(report: dict) -> tuple[list[tuple], int, int]:
    """(primitives, width, height): ("rect", x, y, w, h, fill, stroke) and
    ("text", x, y, text, size, colour, bold, data) in pixels."""
    impls = list(report["impls"])
    rows = report["table"]
    cells: dict[tuple, list] = {}  # (slot, side, impl) -> [(text, colour, data)]
    for r in rows:
        side = "forward" if r["pass"] == "forward" else "backward"
        for impl in impls:
            got, want = r["counts"][impl], r["budget"][impl]
            shown, booked, ok = row_cells(r, impl)
            if (not got and not want) or (r["scope"] == ANY_SCOPE and ok):
                continue  # (an any-scope total that holds: its collectives are drawn)
            head = f"{shown if r['scope'] == ANY_SCOPE else f'{got}x'} {r['kind']}: {role_text(r)}"
            axes = f" over {'+'.join(r['axes'])}" if r.get("axes") else ""
            payload = (f"   {shape_text(r).replace(' ', '')}, {size_text(r['bytes'])}{axes}"
                       + (f"; budget {booked}" if shown != booked else ""))
            data = {"impl": impl, "pass": r["pass"], "kind": r["kind"], "role": role_text(r),
                    "count": got, "budget": want}
            if r.get("axes"):
                data["axes"] = "+".join(r["axes"])
            colour = OK if ok else WARN
            cells.setdefault((slot(r), side, impl), []).extend(
                [(_fit(head), colour, data), (_fit(payload), colour, None)])
    n = len(impls)
    width = 2 * n * COLUMN_W + MODULE_W + 2 * PAD
    mx = PAD + n * COLUMN_W  # the module column's left edge
    out = [("rect", 0, 0, width, 0, "#ffffff", None)]  # height set below
    title = (f"collectives of the compiled train step: tp={report['tp']}, dp={report['dp']}, "
             f"{report['layers']} blocks, b={report['batch']} s={report['seq']} "
             f"h={report['d_model']}, {report['device_kind']} ({report['platform']}); counts per "
             "step (all blocks); red: differs from the budget")
    out.append(("text", PAD, 20, title, FONT + 2, INK, True, None))
    for i, impl in enumerate(impls):
        for side, x in (("forward", PAD + i * COLUMN_W), ("backward", mx + MODULE_W + i * COLUMN_W)):
            verdict = report["impls"][impl].get("verdict", "")
            out.append(("text", x + 4, 44, f"{side}: {impl}", FONT + 1, INK, True, None))
            out.append(("text", x + 4, 58, verdict[:48], FONT - 1,
                        OK if verdict == "matches budget" else WARN, False, None))
    out.append(("text", mx + 4, 44, "module", FONT + 1, INK, True, None))
    y = TOP
    for name, label in MODULES:
        lines = max([len(cells.get((name, side, impl), [])) for side in ("forward", "backward")
                     for impl in impls] + [1])
        h = lines * LINE + 2 * PAD
        in_block = name in BLOCK
        out.append(("rect", mx, y, MODULE_W, h - 2, BOX if in_block else "#f6f6f6", "#8899aa"))
        out.append(("text", mx + 6, y + PAD + FONT, label, FONT, INK, in_block, None))
        for i, impl in enumerate(impls):
            for side, x in (("forward", PAD + i * COLUMN_W),
                            ("backward", mx + MODULE_W + i * COLUMN_W)):
                for j, (text, colour, data) in enumerate(cells.get((name, side, impl), [])):
                    out.append(("text", x + 4, y + PAD + FONT + j * LINE, text, FONT - 1,
                                colour, False, data))
        y += h
    out.append(("text", mx + 6, y + 16, f"block: the shaded modules, x{report['layers']}",
                FONT - 1, INK, False, None))
    height = y + 30
    out[0] = ("rect", 0, 0, width, height, "#ffffff", None)
    return out, width, height


def to_svg(report: dict) -> str:
    prims, width, height = layout(report)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="monospace">']
    for p in prims:
        if p[0] == "rect":
            _, x, y, w, h, fill, stroke = p
            edge = f' stroke="{stroke}"' if stroke else ""
            parts.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}"{edge}/>')
        else:
            _, x, y, text, size, colour, bold, data = p
            attrs = "".join(f" data-{k}={quoteattr(str(v))}" for k, v in (data or {}).items())
            cls = ' class="collective"' if data else ""
            weight = ' font-weight="bold"' if bold else ""
            parts.append(f'<text x="{x}" y="{y}" font-size="{size}" fill="{colour}"{weight}'
                         f'{cls}{attrs}>{_escape(text)}</text>')
    return "\n".join(parts + ["</svg>"]) + "\n"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_png(report: dict, path: Path) -> bool:
    """The same layout drawn with matplotlib; False where it is not installed."""

    try:
        plt = pyplot()
    except NoMatplotlib:
        return False
    from matplotlib.patches import Rectangle  # optional dependency ([plot])

    prims, width, height = layout(report)
    fig = plt.figure(figsize=(width / 100, height / 100), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")
    for p in prims:
        if p[0] == "rect":
            _, x, y, w, h, fill, stroke = p
            ax.add_patch(Rectangle((x, y), w, h, facecolor=fill, edgecolor=stroke or fill))
        else:
            _, x, y, text, size, colour, bold, _ = p
            ax.text(x, y, text, fontsize=size * 0.75, color=colour, family="monospace",
                    weight="bold" if bold else "normal", va="baseline")
    fig.savefig(path)
    plt.close(fig)
    return True


def write(report: dict, out_dir: Path, log=print) -> list[Path]:
    """`collectives.svg` (and `.png` with matplotlib) in `out_dir`."""
    out_dir = Path(out_dir)
    svg = out_dir / "collectives.svg"
    svg.write_text(to_svg(report))
    written = [svg]
    if to_png(report, out_dir / "collectives.png"):
        written.append(out_dir / "collectives.png")
    log(f"drew {' and '.join(str(p) for p in written)}")
    return written


def ring_bytes_by_axes(expected: list[Expected]) -> dict[str, float]:
    """A budget's ring traffic per rank per step, by the mesh axes of its rows
    ("tp", "dp", "dp+tp"): what each communication group's links carry."""
    out: dict[str, float] = {}
    for e in expected:
        key = "+".join(e.axes)
        out[key] = out.get(key, 0.0) + e.count * e.ring_bytes
    return dict(sorted(out.items()))


def format_table(colls_by_impl: dict, expected_by_impl: dict,
                 mesh: dict[str, int] | None = None) -> list[str]:
    """`table_rows` side by side: per impl its count and its budget's, then
    the role; with `mesh`, an axes column, rows grouped by it, and a line per
    axis with each impl's budgeted ring bytes per rank per step."""
    impls = list(colls_by_impl)
    head = ["kind", "pass", "scope", "dtype[shape]", "devices", "bytes each"]
    head = (["axes"] if mesh else []) + head
    for impl in impls:
        head += [impl, "budget"]
    head.append("role")
    rows = [head]
    for r in table_rows(colls_by_impl, expected_by_impl, mesh):
        row = [r["kind"], r["pass"], r["scope"] or "-", shape_text(r), str(r["devices"]),
               size_text(r["bytes"])]
        row = (["+".join(r["axes"]) or "-"] if mesh else []) + row
        for impl in impls:
            row += list(row_cells(r, impl)[:2])
        rows.append(row + [role_text(r)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if mesh:
        ring = {impl: ring_bytes_by_axes(expected_by_impl[impl]) for impl in impls}
        for axes in sorted({a for r in ring.values() for a in r}):
            lines.append(f"ring traffic per rank per step over {axes}: " + ", ".join(
                f"{size_text(ring[impl].get(axes, 0))} ({impl})" for impl in impls))
    return lines
