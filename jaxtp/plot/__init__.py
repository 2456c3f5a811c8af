"""Figures of training runs and benchmarks, drawn with matplotlib (the
`[plot]` extra): `python -m jaxtp.plot runs RUN_DIR...` and `python -m
jaxtp.plot bench BENCH_DIR`. (`--compare-hlo`'s picture of the collectives
needs nothing: `jaxtp.analysis.picture`.)"""

from pathlib import Path

INSTALL_HINT = 'pip install -e ".[plot]"  (or: pip install matplotlib)'


class NoMatplotlib(ImportError):
    """matplotlib is not installed."""


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (matplotlib is an
    optional dependency: imported here, when a figure is drawn)."""
    try:
        import matplotlib
    except ImportError as e:
        raise NoMatplotlib(f"jaxtp.plot draws with matplotlib, which is not installed: "
                           f"{INSTALL_HINT}") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, out_dir, name: str) -> list:
    """`name`.png and `name`.svg in `out_dir`; the paths written."""
    paths = [Path(out_dir) / f"{name}.{ext}" for ext in ("png", "svg")]
    for p in paths:
        fig.savefig(p, dpi=120, bbox_inches="tight")
    return paths
