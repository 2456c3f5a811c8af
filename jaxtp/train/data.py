"""Token data: a built-in corpus, user files, and batches placed on the mesh.

The built-in corpus is real text every Python has: the standard library's own
top-level `.py` files, byte-level (vocab 256), sorted by name so every machine
with the same Python builds the same corpus. The last `val_fraction` of the
bytes is the validation split.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from .. import data as token_files
from ..parallel import batch_sharding, cp_batch, named, sequence_split
from ..parallel.distributed import global_batch

BUILTIN_MAX_BYTES = 8 * 2**20


def builtin_corpus(max_bytes: int = BUILTIN_MAX_BYTES) -> np.ndarray:
    """Bytes of the Python standard library's top-level sources (uint8)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no .py files under {stdlib}; pass --data PATH")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def load_tokens(path: str | None) -> np.ndarray:
    """None -> built-in corpus; a token file (`jaxtp.data`) -> its ids,
    memory-mapped; `*.bin` -> flat uint16 token ids; else UTF-8 text as bytes."""
    if path is None:
        return builtin_corpus()
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"--data {path} is a directory: give one text, token or "
                                ".bin file")
    if not p.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    if token_files.is_token_file(p):
        return token_files.read_tokens(p)[0]
    if p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise ValueError(f"--data {path}: a .bin file holds uint16 ids, but its size "
                             f"{p.stat().st_size} is odd")
        return np.fromfile(p, dtype=np.uint16)
    raw = p.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--data {path} is not UTF-8 text ({e}); token ids go in a "
                         ".bin file of uint16") from None
    return np.frombuffer(raw, dtype=np.uint8)


FINGERPRINT_WHOLE = 16 * 2**20  # hash files up to this many bytes whole
FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK = 64, 256 * 2**10  # else 16 MiB sampled evenly


def data_identity(tokens: np.ndarray, source: str | None) -> dict:
    """What a run records of its data, to recognise it by content on resume:
    the token count and dtype, and a sha256 of the token bytes (whole up to
    16 MiB, else of 64 blocks of 256 KiB spread evenly from first to last,
    which reads 16 MiB of any file). `source` (the path, or None for the
    built-in corpus) is kept for the reader, not compared."""
    raw = np.ascontiguousarray(tokens).view(np.uint8).reshape(-1)
    h = hashlib.sha256(f"{tokens.dtype.name}:{raw.size}:".encode())
    if raw.size <= FINGERPRINT_WHOLE:
        h.update(raw.tobytes())
    else:
        last = raw.size - FINGERPRINT_BLOCK
        for start in np.linspace(0, last, FINGERPRINT_BLOCKS).astype(np.int64):
            h.update(raw[start:start + FINGERPRINT_BLOCK].tobytes())
    return {"source": source or "builtin", "tokens": int(tokens.size),
            "dtype": tokens.dtype.name, "sha256": h.hexdigest()}


def same_data(saved: dict | str, now: dict) -> bool:
    """Whether a checkpoint's recorded data is this data (by content; a
    checkpoint from before content fingerprints recorded "PATH (N tokens)":
    then the count is all there is to compare)."""
    if isinstance(saved, str):
        return saved.endswith(f"({now['tokens']} tokens)")
    return all(saved.get(k) == now[k] for k in ("tokens", "dtype", "sha256"))


class Windows:
    """A batch of windows [B, T+1] of a token array, read when asked: a process
    of a multi-process run reads only the rows its devices hold (`to_mesh`),
    so a memory-mapped file is touched only there. np.asarray reads them all.
    `read(starts)`: the windows at those starts (`Dataset._read`)."""

    def __init__(self, read: Callable[[np.ndarray], np.ndarray], starts: np.ndarray,
                 seq_len: int):
        self.read, self.starts = read, starts
        self.shape, self.ndim, self.dtype = (len(starts), seq_len + 1), 2, np.dtype(np.int32)

    def rows(self, lo: int, hi: int) -> np.ndarray:
        return self.read(self.starts[lo:hi])

    def __array__(self, dtype=None, copy=None):
        rows = self.rows(0, self.shape[0])
        return rows if dtype is None else rows.astype(dtype)

    def __getitem__(self, key):
        return np.asarray(self)[key]


class Dataset:
    """Train/validation token arrays with random (train) and fixed (eval) windows."""

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int,
                 val_fraction: float = 0.1, max_id: int | None = None,
                 vocab_of: str | None = None):
        """`max_id`: the largest id, where known (a token file's header), so
        that a memory-mapped file is not read whole to find it; every window
        read is checked too, so a header that understates it stops the run at
        the batch that holds the id. `vocab_of`: a checkpoint directory that
        fixes the vocabulary (no raising it then)."""
        # a token file is a memmap: its name is the file's
        self.source, self.max_id = getattr(tokens, "filename", None), max_id
        self.vocab_size = vocab_size
        top = max_id if max_id is not None else int(tokens.max()) if tokens.size else -1
        if top >= vocab_size:
            fix = (f"the checkpoint {vocab_of} fixes it: tokenize the data with its tokenizer "
                   f"(python -m jaxtp.data prepare --tokenizer {vocab_of} ...)" if vocab_of
                   else "raise model.vocab_size above it")
            raise ValueError(f"data has token id {top} but model.vocab_size={vocab_size}"
                             f"{f' ({self.source})' if self.source else ''}; {fix}")
        n_val = int(len(tokens) * val_fraction)
        self.train, self.val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
        need = seq_len + 2
        for name, split in (("train", self.train), ("validation", self.val)):
            if len(split) < need:
                raise ValueError(f"{name} split has {len(split)} tokens, fewer than "
                                 f"model.seq_len+2={need}; use more data or a shorter seq_len")
        self.seq_len = seq_len

    def _read(self, split: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """The windows [len(starts), T+1] of `split` at `starts`, as int32, their
        ids checked against the vocabulary (a max over the batch being read)."""
        ids = split[starts[:, None] + np.arange(self.seq_len + 1)[None]]
        top = int(ids.max(initial=0))
        if top >= self.vocab_size:
            said = "" if self.max_id is None else \
                f", whose header says its largest id is {self.max_id}"
            raise ValueError(f"data has token id {top} but model.vocab_size={self.vocab_size} "
                             f"({self.source or 'the data'}{said}): the file is damaged; "
                             "prepare it again with python -m jaxtp.data prepare")
        return ids.astype(np.int32)

    def train_batches(self, batch_size: int, seed: int, skip: int = 0):
        """Endless random windows [B, T+1] from the train split; `skip`: start
        after that many batches (a resumed run sees the batches a straight run
        would, as the window starts are drawn ahead without reading tokens)."""
        rng = np.random.default_rng(seed)
        last = len(self.train) - self.seq_len - 1  # the last window that fits
        for _ in range(skip):
            rng.integers(0, last + 1, batch_size)
        read = functools.partial(self._read, self.train)
        while True:
            yield Windows(read, rng.integers(0, last + 1, batch_size), self.seq_len)

    def eval_batches(self, batch_size: int, n: int) -> list[np.ndarray]:
        """`n` fixed batches, evenly spaced over the validation split."""
        hi = len(self.val) - self.seq_len - 1
        starts = np.linspace(0, hi, n * batch_size).astype(np.int64)
        return [self._read(self.val, s) for s in starts.reshape(n, batch_size)]


def to_mesh(batch, mesh: Mesh, cp_balance: bool = True) -> jax.Array:
    """Place a host batch [B, ...] on the mesh: split over dp, replicated over tp.

    `batch` is the global batch, the same in every process (it is drawn from
    the seed); each process transfers only the rows its own devices hold,
    and of `Windows` reads only those rows. On a mesh with a cp axis, windows
    [B, T+1] become inputs and targets [B, 2, T] split along T over cp, in
    the order of `jaxtp.parallel.cp_order` (`cp_balance`: the causal load
    balance); every process reads its rows whole then.
    """
    cp = sequence_split(mesh)
    if cp > 1:
        return global_batch(cp_batch(np.asarray(batch), cp, cp_balance), mesh,
                            batch_sharding(mesh))
    sharding = named(mesh, "batch", *([None] * (batch.ndim - 1)))
    # a process's rows are one block on a (dp, tp) mesh whose dp ranks are
    # laid out by process, as make_mesh does
    if isinstance(batch, Windows) and jax.process_count() > 1:
        held = [i[0] for i in sharding.addressable_devices_indices_map(batch.shape).values()]
        lo = min(s.start or 0 for s in held)
        hi = max(batch.shape[0] if s.stop is None else s.stop for s in held)
        return jax.make_array_from_process_local_data(sharding, batch.rows(lo, hi),
                                                      batch.shape)
    return global_batch(np.asarray(batch), mesh, sharding)

