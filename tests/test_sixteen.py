"""The four- and five-axis layouts on 16 fake devices (tests/sixteen.py), in
a process of their own: the suite's has 8."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow
def test_sixteen_device_layouts_equal_one_device_and_hold_their_ledgers():
    env = {**os.environ, "JAXTP_TEST_DEVICES": "16"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
                          "no:cacheprovider", str(HERE / "sixteen.py")],
                         cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout
