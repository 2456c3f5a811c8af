"""A run's directory: the config it started with, what each resume changed,
and what else its first start was given. No JAX here: the CLI reads it
before JAX starts (the saved tp and dp decide how many devices to make).

- `config.json`: the config the run started with, never rewritten;
- `resumes.jsonl`: one JSON line per resume that changed something: when,
  the command line, and each changed key as [before, after]. The run's
  config is `config.json` with these applied in order;
- `launch.json`: the first start's `--data` and `--init-from-hf` (absolute
  paths), so that `python train.py --resume --out DIR` alone restarts it,
  and the end-of-text id(s) of its tokenizer (`eos`, for generate.py);
- `tokenizer.json`: the tokenizer of a token file or HF checkpoint, if any;
- `writer.lock`: an exclusive advisory lock (flock) held by the one process
  that writes the run, with its host, PID and start time. The kernel drops
  it when that process dies, however it dies, so a requeued job never finds
  a stale lock; a second writer while it lives is refused (`RunInUse`), and
  so is a writer.lock that is not a regular file (never followed: a link
  would have the run overwrite the file it points to).

A resume may change only what leaves the run the same run (`RESUMABLE`):
the layout (checkpoints reshard), how the same math is computed (remat,
attention kernel, loss chunks, microbatches), logging, evaluation and
checkpointing, and `train.steps` (the schedule's length, with a warning).
Anything else is refused, naming the key.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from ..config import Config, ConfigError, validate

# what a resume may change: the config's fields marked resumable (jaxtp.config)
RESUMABLE = Config.resumable_keys()


def flat(cfg: Config) -> dict:
    """{"section.key": value} of a config."""
    return {f"{s}.{k}": v for s, sec in cfg.to_dict().items() for k, v in sec.items()}


def _apply(cfg: Config, values: dict) -> Config:
    d = cfg.to_dict()
    for key, value in values.items():
        section, name = key.split(".")
        d[section][name] = value
    return Config.from_dict(d)


class RunInUse(ConfigError):
    """Another live process writes this run directory."""


class RunLock:
    """The run directory's writer lock, held from `RunDir.lock` until `release`
    (or the process's death)."""

    def __init__(self, fd: int):
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunDir:
    """The files of one run directory (see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.config_path = self.path / "config.json"
        self.history_path = self.path / "resumes.jsonl"
        self.launch_path = self.path / "launch.json"

    def has_run(self) -> bool:
        return self.config_path.is_file()

    def lock(self) -> RunLock:
        """Take the writer lock (creating the directory), before anything of
        the run is written. RunInUse names the live holder; an OSError (with
        its strerror) if the directory cannot be written; a ConfigError naming
        the lock if it is not a regular file (a symbolic link is not followed:
        the holder's line would overwrite the file it points to)."""
        self.path.mkdir(parents=True, exist_ok=True)
        path = self.path / "writer.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise
            raise _not_a_lock(path) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device
            os.close(fd)
            raise _not_a_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise RunInUse(f"--out {self.path} is being written by another run "
                           f"({_holder(path)}): wait for it to finish, or stop it; then "
                           f"--resume --out {self.path} continues the run") from None
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        except OSError:
            os.close(fd)
            raise
        return RunLock(fd)

    def _read_json(self, path: Path):
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is damaged ({e}); it records the run: restore it, "
                              "or start a new run in another directory") from None

    def config(self) -> Config:
        """The run's config now: config.json with each resume's changes applied."""
        cfg = Config.from_dict(self._read_json(self.config_path))
        for entry in self.history():
            cfg = _apply(cfg, {k: new for k, (_, new) in entry["changes"].items()})
        return validate(cfg)

    def history(self) -> list[dict]:
        if not self.history_path.is_file():
            return []
        lines = self.history_path.read_text().splitlines()
        try:
            return [json.loads(line) for line in lines if line.strip()]
        except json.JSONDecodeError:
            raise ConfigError(f"{self.history_path} is damaged: each line must be JSON; "
                              "remove the broken line (it records a resume's changes)") from None

    def launch(self) -> dict:
        return self._read_json(self.launch_path) if self.launch_path.is_file() else {}

    def start(self, cfg: Config, data: str | None, init_from_hf: str | None,
              tokenizer: Path | None = None, eos: list[int] = ()) -> None:
        """Record a new run (process 0 only): the tokenizer its data was made
        with (as tokenizer.json, for generate.py), launch.json, then
        config.json, each whole or not at all (a kill mid-write leaves no run,
        not half a one)."""
        if tokenizer is not None:
            write_atomic(self.path / "tokenizer.json", Path(tokenizer).read_text())
        absolute = lambda p: os.path.abspath(p) if p else None
        write_atomic(self.launch_path, json.dumps(
            {"data": absolute(data), "init_from_hf": absolute(init_from_hf),
             "eos": list(eos)}, indent=2) + "\n")
        write_atomic(self.config_path, json.dumps(cfg.to_dict(), indent=2) + "\n")

    def changes(self, cfg: Config) -> dict[str, tuple]:
        """{key: (the run's, asked)} for a resume of this run as `cfg`; a
        ConfigError names every key a resume may not change."""
        run, asked = flat(self.config()), flat(cfg)
        changed = {k: (run[k], asked[k]) for k in run if run[k] != asked[k]}
        refused = [k for k in changed if k not in RESUMABLE]
        if refused:
            said = ", ".join(f"{k}={changed[k][1]!r} (the run has {changed[k][0]!r})"
                             for k in refused)
            raise ConfigError(
                f"--resume: {said}: a resumed run keeps its config ({self.config_path}); it "
                "may change only the layout, remat/attention/loss chunks/microbatches, "
                "logging, evaluation, checkpointing and train.steps. Drop the flag, or start "
                "a new run in another directory")
        return changed

    def resumed(self, changes: dict[str, tuple], step: int, argv: list[str]) -> None:
        """Append a resume's changes to the history (process 0 only)."""
        if not changes:
            return
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "step": step, "argv": argv,
                 "changes": {k: list(v) for k, v in changes.items()}}
        lines = [json.dumps(h) for h in self.history()] + [json.dumps(entry)]
        write_atomic(self.history_path, "".join(line + "\n" for line in lines))


def _not_a_lock(path: Path) -> ConfigError:
    """The refusal of a writer.lock that is not a regular file, saying what it is."""
    mode = os.lstat(path).st_mode
    kind = (f"a symbolic link to {os.readlink(path)}" if stat.S_ISLNK(mode) else
            "a directory" if stat.S_ISDIR(mode) else
            "a named pipe" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device file")
    return ConfigError(f"the run's writer lock {path} is {kind}, not a regular file: move "
                       "it aside (the run makes its own) and start again")


def _holder(path: Path) -> str:
    """Who holds the lock at `path`, as its file says."""
    try:
        h = json.loads(path.read_text())
        return f"process {h['pid']} on {h['host']}, since {h['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its lock file {path} names no holder yet"


__all__ = ["RunDir", "RunInUse", "RunLock", "RESUMABLE", "flat", "write_atomic"]
