"""Every case of tests/faults.py (bad input, a second writer, file systems
that refuse a save), run as a user runs it: one line on stderr with its
documented exit code, nothing lost, nothing left behind."""

import pytest

import faults

MOUNT = faults.can_mount()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")  # the base run is made in it once, when needed


@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else [])
    for c in faults.CASES])
def test_fault(case, work, tmp_path):
    if case.mounts and MOUNT:
        pytest.skip(MOUNT)
    if case.unless():
        pytest.skip(case.unless())
    faults.check(case, case.go(work, tmp_path), tmp_path)


def test_the_readme_samples_greedily():
    """The README's third command: the 300-step model at temperature 0.8
    prints mostly spaces; its example shows greedy text."""
    from procs import ROOT

    example = next(line for line in (ROOT / "README.md").read_text().splitlines()
                   if line.startswith("python train.py --tp 8 --out runs/tiny && python generate.py"))
    words = example.split()
    assert words[words.index("--temperature") + 1] == "0", example
