"""`RunOptions`: what a call of `jaxtp.train.loop.train` may ask beyond the
config (which says what is trained): where the data is, what to start from,
how to log, drills and when to stop. None of it changes the run's math."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


class Notice(str):
    """A line of the log that is not the run's progress: a warning, or where a
    stopped run stands. A `log` that keeps them apart can tell (train.py
    prints them on stderr); to any other they are lines like the rest."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
    data_path: str | None = None  # text, token file or .bin (None: the built-in corpus)
    log: Callable[[str], None] = print
    # the first steps replayed on one device and compared (run.json)
    check: bool = False
    # starting values (an nnx.State or nested dict, e.g. from jaxtp.hf.read_hf),
    # or a function that reads them (called only when nothing is restored)
    init_params: Any = None
    # continue the run in out_dir from its latest complete checkpoint (any
    # tp/dp), from step 0 if it has none yet, or start it if out_dir holds no
    # run: one call for a job that a cluster may requeue
    resume: bool = False
    inject_nan_at: frozenset = frozenset()  # steps whose gradients are made NaN (a drill)
    # per-device peak for MFU, where jaxtp.hardware.HARDWARE lacks the device
    peak_tflops: float | None = None
    tensorboard: bool = False  # also write the rows as TensorBoard scalars
    # stop after this step with a checkpoint (the schedule still spans train.steps)
    until: int | None = None
    init_from_hf: str | None = None  # recorded in launch.json (train.py's --init-from-hf)
    argv: tuple = ()  # the command line, recorded with a resume's changes
    # say when train.warmup_steps >= train.steps (train.py: not where the
    # command line set --steps and left the config's warmup, a smoke run)
    warn_warmup: bool = True

    def __post_init__(self):
        object.__setattr__(self, "inject_nan_at", frozenset(self.inject_nan_at))
        object.__setattr__(self, "argv", tuple(self.argv))


__all__ = ["RunOptions"]
