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


def test_every_module_is_in_the_package_map():
    """docs/packages.md names every module of jaxtp (by file name; a bench or
    plot module by its name in its package's line)."""
    text = (ROOT / "docs" / "packages.md").read_text()
    missing = []
    for f in sorted((ROOT / "jaxtp").rglob("*.py")):
        if f.name in ("__init__.py", "__main__.py"):
            continue
        short = f.parent.name in ("bench", "plot")
        if not re.search(rf"\b{re.escape(f.name if not short else f.stem)}\b", text):
            missing.append(str(f.relative_to(ROOT)))
    assert not missing, missing


# every flag a user combines, as the command line sets it (on moe-tiny's
# model, dense but for "MoE with ep"; the default impl, gspmd)
COMPOSED = {
    "`--tp 2`": ["parallel.tp=2"],
    "`--dp 2 --fsdp`": ["parallel.dp=2", "parallel.fsdp=true"],
    "`--microbatches 2`": ["train.microbatches=2"],
    "`--sp`": ["parallel.tp=2", "parallel.sp=true"],
    "`--sp --overlap collective_matmul`": ["parallel.tp=2", "parallel.sp=true",
                                           "parallel.overlap=collective_matmul"],
    "`--cp 2` (allgather)": ["parallel.cp=2"],
    "`--cp 2 --cp-attention ring`": ["parallel.cp=2", "parallel.cp_attention=ring"],
    "`--pp 2` (GPipe)": ["parallel.pp=2", "train.microbatches=2"],
    "`--pp 2 --pp-schedule circular --pp-repeats 2`": [
        "parallel.pp=2", "parallel.pp_schedule=circular", "parallel.pp_repeats=2",
        "train.microbatches=2"],
    "`--pp 2 --pp-schedule 1f1b`": ["parallel.pp=2", "parallel.pp_schedule=1f1b",
                                    "train.microbatches=2"],
    "`--pp 2 --pp-schedule interleaved --pp-repeats 2`": [
        "parallel.pp=2", "parallel.pp_schedule=interleaved", "parallel.pp_repeats=2",
        "train.microbatches=2"],
    "`--pp 2 --pp-schedule zb`": ["parallel.pp=2", "parallel.pp_schedule=zb",
                                  "train.microbatches=2"],
    "MoE with `--ep 2` (capacity factor 1.25)": ["model.n_experts=8", "parallel.ep=2"],
    "`--impl shard_map`": ["parallel.impl=shard_map"],
    "`--impl explicit`": ["parallel.impl=explicit"],
}
# one choice's alternatives are not a pair
_ALTERNATIVES = ({"`--cp 2` (allgather)", "`--cp 2 --cp-attention ring`"},
                 {"`--impl shard_map`", "`--impl explicit`"},
                 {"`--pp 2` (GPipe)", "`--pp 2 --pp-schedule circular --pp-repeats 2`",
                  "`--pp 2 --pp-schedule 1f1b`",
                  "`--pp 2 --pp-schedule interleaved --pp-repeats 2`",
                  "`--pp 2 --pp-schedule zb`"})


def composition() -> list[str]:
    """docs/scale.md's table of what composes, from the config's checks:
    each flag against every other, a pair refused by `validate` (or refused
    with a capacity factor, accepted dropless) said with the refusal."""
    from jaxtp.config import apply_overrides, load_config, validate
    from jaxtp.config import ConfigError

    base = apply_overrides(load_config("moe-tiny"), ["model.n_experts=0"])

    def refusal(over):
        try:
            validate(apply_overrides(base, over))
            return None
        except ConfigError as e:
            return str(e)

    why, lines = [], ["| flag | with every other flag but |", "| --- | --- |"]
    for a in COMPOSED:
        said = []
        for b in COMPOSED:
            if a == b or any({a, b} <= alt for alt in _ALTERNATIVES):
                continue
            refused = refusal(COMPOSED[a] + COMPOSED[b])
            if refused is None:
                continue
            dropless = refusal(COMPOSED[a] + COMPOSED[b] + ["model.capacity_factor=0"]) is None
            if refused not in why:
                why.append(refused)
            said.append(f"{b}{' (dropless only)' if dropless else ''} [{why.index(refused) + 1}]")
        lines.append(f"| {a} | {', '.join(said) or 'none: composes with all'} |")
    return lines + [""] + [f"{i}. {w}" for i, w in enumerate(why, 1)]


def test_the_composition_table_is_the_configs_checks():
    text = (ROOT / "docs" / "scale.md").read_text()
    begin, end = "<!-- composition: begin -->\n", "<!-- composition: end -->"
    doc = text[text.index(begin) + len(begin):text.index(end)].strip().splitlines()
    want = composition()
    assert doc == want, "docs/scale.md's table should read:\n" + "\n".join(want)
