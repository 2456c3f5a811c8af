"""What orbax says when something fails, as one line: `brief` names an
exception's root cause, and `quiet_orbax` silences the tracebacks orbax and
tensorstore print for errors `jaxtp.train.checkpoint` reports itself (and
orbax's warning on replacing a half-written step, which it notes itself);
`quiet_abandoned_reads` drops what the reads of a failed restore print as
they are collected."""

from __future__ import annotations

import inspect
import logging
import os
import re
import sys
import traceback
import warnings


class _QuietClosedLoop:
    """After a failed background save, tensorstore still completes the writes
    orbax gave up on, into orbax's closed event loop: one unraisable
    "Event loop is closed" per array. Dropped; anything else goes on."""

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, unraisable) -> None:
        if not (unraisable.exc_type is RuntimeError
                and str(unraisable.exc_value) == "Event loop is closed"):
            self.hook(unraisable)


class _QuietOrbax(logging.Filter):
    """Orbax logs each failed background write with its traceback (~320 lines
    for one full disk, and asyncio then one "exception was never retrieved"
    per array), before raising it; `Checkpointer` reports every orbax error
    it catches as one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            # a step a killed save left half-written: Checkpointer.save says so itself
            return not record.getMessage().startswith("Attempted to create temporary directory")
        exc, tb = record.exc_info[1:] if record.exc_info else (None, None)
        frames = traceback.extract_tb(tb) if tb is not None else []
        # a tensorstore write's error reaches asyncio without orbax's frames
        # (set on its future from C++); it names orbax's temporary directory.
        # So does a read of a damaged step that restore abandoned once another
        # read failed (its future's error never retrieved): it names orbax's
        # OCDBT database, and `Checkpointer.restore` reported the step
        mentions = f"{record.getMessage()} {exc}"
        return not ("orbax" in record.pathname or any("orbax" in f.filename for f in frames)
                    or ".orbax-checkpoint-tmp" in mentions
                    or (exc is not None and "in OCDBT database at" in str(exc)))


def quiet_orbax() -> None:
    """Install both filters, once per process (they stay: they drop only
    orbax's own error records and the closed-loop unraisables)."""
    for logger in map(logging.getLogger, ("absl", "asyncio")):
        if not any(isinstance(f, _QuietOrbax) for f in logger.filters):
            logger.addFilter(_QuietOrbax())
    if not isinstance(sys.unraisablehook, _QuietClosedLoop):
        sys.unraisablehook = _QuietClosedLoop(sys.unraisablehook)


def brief(e: BaseException) -> str:
    """An exception as one short line: its root cause (orbax wraps tensorstore's
    error in one whose text is a pybind11 method repr), with the OS error's
    name where there is one (e.g. "No space left on device")."""
    for _ in range(10):  # a chain, not a cycle; `raise ... from None` ends it
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__) or e
    text = (str(e).strip().splitlines() or [""])[0].replace("\\'", "'")
    code = re.search(r"\[os_error_code='?(\d+)'?\]", text)
    if code:  # a file system error: its name and the file are what matter
        file = re.search(r'Failed writing: "([^"]+)"', text)
        return (f"{os.strerror(int(code.group(1)))} (errno {code.group(1)})"
                + (f" writing {file.group(1)}" if file else ""))
    return f"{type(e).__name__}: {text[:300]}"


class _QuietAbandonedReads:
    """Orbax 0.12.8 runs a restore in an event loop that it closes without
    cancelling what is left (`asyncio_utils._run_sync_via_new_loop`): when
    one read of a damaged step fails, the step's other reads stay suspended,
    and as the garbage collector closes each (at any later time, exit
    included) orbax turns its GeneratorExit into an Exception that Python
    prints as "Exception ignored in: <coroutine ...>" with a TensorStore spec,
    ~60 lines per read. `restore` reports the step in one line: these are
    dropped; any other unraisable goes on."""

    def __init__(self, hook):
        self.hook = hook

    def __call__(self, unraisable) -> None:
        coro, exc = unraisable.object, unraisable.exc_value
        closed = any(isinstance(e, GeneratorExit)  # orbax raises `from` it
                     for e in (exc, getattr(exc, "__cause__", None)))
        if not (closed and inspect.iscoroutine(coro) and "orbax" in coro.cr_code.co_filename):
            self.hook(unraisable)


def quiet_abandoned_reads() -> None:
    """Install `_QuietAbandonedReads` once per process (it stays), and drop
    the other trace of the same abandoned restore: a read that orbax had
    scheduled as a task when the failing one closed its loop never starts,
    and Python warns "coroutine '<name>' was never awaited" (plus a tracemalloc
    hint) as it collects it, at exit if not before. Only orbax's
    serialization coroutines are named in the filter."""
    try:  # (a private module of orbax 0.12: where it moves, no filter)
        from orbax.checkpoint._src.serialization import serialization
    except ImportError:
        serialization = None
    names = [] if serialization is None else sorted(
        n for n, f in vars(serialization).items() if inspect.iscoroutinefunction(f))
    if names:
        warnings.filterwarnings(
            "ignore", f"coroutine '({'|'.join(map(re.escape, names))})' was never awaited",
            RuntimeWarning)
    hook = sys.unraisablehook
    while hook is not None:
        if isinstance(hook, _QuietAbandonedReads):
            return
        hook = getattr(hook, "hook", None)  # a filter wrapping another (orbax_errors)
    sys.unraisablehook = _QuietAbandonedReads(sys.unraisablehook)
