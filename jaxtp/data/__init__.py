"""Token files: text tokenized once with a Hugging Face tokenizer, read
memory-mapped (`python -m jaxtp.data prepare`; `train.py --data FILE`).

A token file is a 4096-byte header, then the token ids, little-endian,
uint16 when the tokenizer's vocabulary fits, else uint32. The header is
b"JAXTPTOK", a uint32 length, and a JSON object: format, dtype, vocab_size
(the tokenizer's), tokenizer (its file name) and tokenizer_sha256, eos_id,
n_tokens, max_id, documents (`FIELDS`, each checked when read; `max_id` is
not trusted alone: `jaxtp.train.data` checks the ids it reads). The
tokenizer itself is copied next to the file as FILE.tokenizer.json, so a run
(and generate.py) can decode. Reading maps the file: a process touches only
the pages of the windows it draws.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .tokenizer import load_tokenizer

MAGIC = b"JAXTPTOK"
HEADER_BYTES = 4096
FORMAT = 1
DTYPES = ("uint16", "uint32")  # the ids' types the format defines (little-endian)
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")


def is_token_file(path: str | os.PathLike) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


# the header's fields and what each holds: one of a tuple's values, a string,
# or an integer of at least the number given
FIELDS = {"format": (FORMAT,), "dtype": DTYPES, "vocab_size": 1, "tokenizer": str,
          "tokenizer_sha256": str, "eos_id": 0, "n_tokens": 0, "max_id": 0, "documents": 0}
_JSON = {dict: "an object", list: "an array", str: "the string", bool: "the boolean",
         int: "the integer", float: "the number", type(None): "null"}


def _held(v) -> str:
    """A JSON value as a message names it: 'the string "384"', 'an array'."""
    if isinstance(v, (dict, list)) or v is None:
        return _JSON[type(v)]
    shown = json.dumps(v)
    return f"{_JSON[type(v)]} {shown if len(shown) <= 40 else shown[:37] + '...'}"


def _wanted(rule) -> str:
    if isinstance(rule, tuple):
        return " or ".join(map(repr, rule))
    return "a string" if rule is str else f"an integer >= {rule}"


def _header_error(header) -> str | None:
    """What is wrong with a header's fields (the first field, what it holds,
    what the format wants), or None."""
    if not isinstance(header, dict):
        return f"is {_held(header)}, not a JSON object of its fields"
    for field, rule in FIELDS.items():
        if field not in header:
            return f"has no {field} (the format wants {_wanted(rule)})"
        v = header[field]
        if isinstance(rule, tuple):  # (1,) is not met by 1.0 or true
            ok = v in rule and type(v) is type(rule[0])
        elif rule is str:
            ok = isinstance(v, str)
        else:  # neither true nor 3.0 is an integer here
            ok = type(v) is int and v >= rule
        if not ok:
            return f"{field} is {_held(v)}, not {_wanted(rule)}"
    return None


def read_header(path: str | os.PathLike) -> dict:
    """A token file's header, its fields checked (ValueError naming the file,
    the field and what the format wants, if it is damaged)."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    again = "prepare it again with python -m jaxtp.data prepare"
    try:
        if head[:len(MAGIC)] != MAGIC:
            raise ValueError("no JAXTPTOK magic")
        n = int.from_bytes(head[len(MAGIC):len(MAGIC) + 4], "little")
        header = json.loads(head[len(MAGIC) + 4:len(MAGIC) + 4 + n])
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a readable token file ({e}); {again}") from None
    wrong = _header_error(header)
    if wrong:
        raise ValueError(f"{path}: its token file header {wrong}; {again}")
    size = os.path.getsize(path) - HEADER_BYTES
    want = header["n_tokens"] * np.dtype(header["dtype"]).itemsize
    if size != want:
        raise ValueError(f"{path} holds {size} bytes of tokens, its header says {want} "
                         f"({header['n_tokens']} {header['dtype']}): a truncated copy?")
    return header


def read_tokens(path: str | os.PathLike) -> tuple[np.ndarray, dict]:
    """(the token ids memory-mapped, the header)."""
    header = read_header(path)
    tokens = np.memmap(path, dtype=np.dtype(header["dtype"]).newbyteorder("<"), mode="r",
                       offset=HEADER_BYTES, shape=(header["n_tokens"],))
    return tokens, header


def _write_header(f, header: dict) -> None:
    body = json.dumps(header).encode()
    if len(MAGIC) + 4 + len(body) > HEADER_BYTES:
        raise ValueError("token file header too long")
    f.seek(0)
    f.write((MAGIC + len(body).to_bytes(4, "little") + body).ljust(HEADER_BYTES, b" "))


def eos_id(tokenizer, name: str | None = None) -> int:
    """The id of `name`, or of the first of the usual end-of-text tokens the
    tokenizer knows."""
    for token in ([name] if name else EOS_NAMES):
        i = tokenizer.token_to_id(token)
        if i is not None:
            return i
    raise ValueError(f"the tokenizer has no {name!r} token" if name else
                     f"the tokenizer has none of {list(EOS_NAMES)}: name its end-of-text "
                     "token with --eos TOKEN")


def _chunks(path: Path, size: int = 2**20) -> Iterable[str]:
    """A UTF-8 file in pieces of about `size` bytes, cut after a newline."""
    with open(path, encoding="utf-8") as f:
        rest = ""
        while True:
            try:
                block = f.read(size)
            except UnicodeDecodeError as e:
                raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte "
                                 f"{e.start} of a block): convert it, e.g. iconv -t utf-8"
                                 ) from None
            if not block:
                break
            block = rest + block
            cut = block.rfind("\n") + 1
            if cut == 0:
                rest = block
                continue
            rest = block[cut:]
            yield block[:cut]
        if rest:
            yield rest


def prepare(tokenizer_path: str | os.PathLike, out: str | os.PathLike,
            texts: list[str | os.PathLike], eos: str | None = None,
            log: Callable[[str], None] = print) -> dict:
    """Tokenize UTF-8 text files (one document each, EOS after each) into the
    token file `out`; returns its header. Files are encoded in pieces of
    about 1 MiB cut at newlines (a token never spans a piece; a normalizer
    that prepends "▁" to its input adds one at each piece)."""
    out = Path(out)
    if out.is_dir():
        raise IsADirectoryError(f"--out {out} is a directory: give the token file's path, "
                                f"e.g. {out / 'tokens.bin'}")
    for t in texts:
        if not Path(t).is_file():
            raise FileNotFoundError(f"{t}: no such file")
        if Path(t).stat().st_size == 0:
            raise ValueError(f"{t} is empty: there is no text to tokenize")
    tokenizer, tok_file = load_tokenizer(tokenizer_path)
    vocab = tokenizer.get_vocab_size()
    dtype = np.dtype("<u2" if vocab <= 2**16 else "<u4")
    header = {"format": FORMAT, "dtype": dtype.name, "vocab_size": vocab,
              "tokenizer": tok_file.name, "eos_id": eos_id(tokenizer, eos),
              "tokenizer_sha256": hashlib.sha256(tok_file.read_bytes()).hexdigest(),
              "n_tokens": 0, "max_id": 0, "documents": 0}
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".tmp")
    try:
        _write_tokens(tmp, header, tokenizer, texts, dtype, log, t0)
    except BaseException:  # an error or Ctrl-C: no half-written file is left
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    (out.with_name(out.name + ".tokenizer.json")).write_bytes(tok_file.read_bytes())
    dt = time.perf_counter() - t0
    log(f"wrote {out}: {header['n_tokens']:,} {dtype.name} tokens of {len(texts)} "
        f"documents in {dt:.1f}s ({header['n_tokens'] / max(dt, 1e-9):,.0f} tokens/s); "
        f"vocabulary {vocab:,}")
    return header


def _write_tokens(path: Path, header: dict, tokenizer, texts, dtype, log, t0: float) -> None:
    """The token file at `path`: its header, then each text's ids and an EOS;
    the header again with the counts."""
    last = t0
    with open(path, "wb") as f:
        _write_header(f, header)
        for doc in texts:
            for piece in _chunks(Path(doc)):
                ids = np.asarray(tokenizer.encode(piece, add_special_tokens=False).ids, dtype)
                f.write(ids.tobytes())
                header["n_tokens"] += ids.size
                header["max_id"] = max(header["max_id"], int(ids.max(initial=0)))
                if time.perf_counter() - last > 2:
                    last = time.perf_counter()
                    log(f"{header['n_tokens']:,} tokens, "
                        f"{header['n_tokens'] / (last - t0):,.0f} tokens/s ({doc})")
            f.write(np.asarray([header["eos_id"]], dtype).tobytes())
            header["n_tokens"] += 1
            header["documents"] += 1
        header["max_id"] = max(header["max_id"], header["eos_id"])
        _write_header(f, header)


__all__ = ["MAGIC", "HEADER_BYTES", "is_token_file", "read_header", "read_tokens", "prepare",
           "eos_id", "load_tokenizer", "DTYPES"]
