"""The docs a newcomer reads: the README stays short, every relative link in
it and in docs/ resolves (files and #anchors), and every flag of every
command-line tool is documented somewhere in docs/."""

import re

import pytest

import generate
import train
from jaxtp.bench import __main__ as bench_cli
from jaxtp.data import __main__ as data_cli
from jaxtp.plot import __main__ as plot_cli
from procs import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation but - and _ dropped,
    spaces as -."""
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title)))
    return out


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target} (no {file})"
        if anchor and file.suffix == ".md":
            assert anchor in _anchors(file), f"{page.name}: {target} (no such heading)"


def _flags(main, argv, capsys) -> set[str]:
    with pytest.raises(SystemExit):
        main(argv)
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", capsys.readouterr().out))


def test_every_cli_flag_is_documented(capsys):
    """docs/cli.md, which says it holds every flag of every tool, does: each
    of train.py's as a row of its table, and in its usage block."""
    cli = (ROOT / "docs" / "cli.md").read_text()
    trained = _flags(train.parse_args, ["--help"], capsys) - {"--help"}
    flags = (trained
             | _flags(generate.parse_args, ["--help"], capsys)
             | _flags(data_cli.main, ["prepare", "--help"], capsys)
             | _flags(plot_cli.main, ["runs", "--help"], capsys)
             | _flags(plot_cli.main, ["bench", "--help"], capsys)
             | _flags(bench_cli.main, ["--help"], capsys))
    assert len(flags) > 40 and "--float64" in trained, flags
    missing = sorted(f for f in flags - {"--help"} if f not in cli)
    assert not missing, missing
    table = cli[cli.index("## Every flag of train.py"):cli.index("## Every flag of generate.py")]
    usage = cli[cli.index("python train.py ["):cli.index("```", cli.index("python train.py ["))]
    assert not sorted(f for f in trained if f"| `{f} " not in table and
                      f"| `{f}`" not in table)
    assert not sorted(f for f in trained if not re.search(rf"(?<=[\[ ]){f}(?=[ \]])", usage))
