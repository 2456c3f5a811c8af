"""What the command-line tools share: usage errors as one line.

argparse prints its whole usage block (16 lines for train.py) before the
reason of a bad flag; a user needs the reason and where to read more.
"""

from __future__ import annotations

import argparse
import sys

EXIT_USAGE = 2

# train.py's flags that set one config key, by argparse dest (their help says
# which, and the default; a refusal of the key names the flag: jaxtp.checks)
FLAG_KEYS = {"tp": "parallel.tp", "dp": "parallel.dp", "cp": "parallel.cp", "ep": "parallel.ep",
             "pp": "parallel.pp", "pp_schedule": "parallel.pp_schedule",
             "pp_repeats": "parallel.pp_repeats",
             "cp_attention": "parallel.cp_attention", "impl": "parallel.impl",
             "sp": "parallel.sp", "overlap": "parallel.overlap", "fsdp": "parallel.fsdp",
             "microbatches": "train.microbatches", "capacity_factor": "model.capacity_factor",
             "scan": "model.scan_layers", "remat": "model.remat", "attention": "model.attention",
             "steps": "train.steps", "seed": "train.seed",
             "checkpoint_every": "train.checkpoint_every"}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr, exit 2."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(EXIT_USAGE)


def positive(kind):
    """An argparse type: a finite number of `kind` above 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a positive {kind.__name__}")
        return value
    return parse


__all__ = ["EXIT_USAGE", "FLAG_KEYS", "Parser", "positive"]
