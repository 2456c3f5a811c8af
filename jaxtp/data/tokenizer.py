"""Tokenizers: bytes for the built-in corpus and plain text, or a Hugging
Face `tokenizer.json` through the optional `tokenizers` package (imported
only when one is read, so that this module stays light); which one a run's
data was made with."""

from __future__ import annotations

import codecs
import json
import os
from pathlib import Path


def load_tokenizer(path: str | os.PathLike, what: str = "--tokenizer"):
    """(a `tokenizers.Tokenizer`, its file) from tokenizer.json or a directory
    holding one; one-line errors for a missing package, file or a file the
    package cannot read."""
    try:
        from tokenizers import Tokenizer  # optional dependency: imported when one is read
    except ImportError:
        raise ImportError("reading a tokenizer needs the tokenizers package: "
                          "pip install -e '.[data]'") from None
    file = Path(path)
    file = file / "tokenizer.json" if file.is_dir() else file
    if not file.is_file():
        raise FileNotFoundError(f"{what} {path}: no tokenizer.json there")
    try:
        return Tokenizer.from_file(str(file)), file
    except Exception as e:  # the Rust binding raises a bare Exception
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{what} {file}: not a tokenizer.json the tokenizers package can "
                         f"read ({reason})") from None


class ByteTokenizer:
    """Byte-level text (vocab 256): the built-in corpus and plain text files."""

    name = "bytes"
    eos: frozenset = frozenset()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decoder(self):
        """A function of new token ids -> the text they complete (UTF-8 split
        across tokens is held back until whole; `final=True` at the end gives
        what is held as U+FFFD, as a whole decode would)."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda ids, final=False: dec.decode(bytes(ids), final=final)


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, through the `tokenizers` package.

    `eos`: the end-of-text id(s); default: an HF checkpoint's `eos_token_id`
    (its config.json beside the tokenizer). `special`: whether encoding adds
    the tokenizer's special tokens (an HF checkpoint's BOS; not for a run
    trained on a token file, whose text was encoded without them)."""

    def __init__(self, path: str | Path, eos=None, special: bool = True):
        self.tok, file = load_tokenizer(path, "tokenizer")
        self.name, self.special = str(file), special
        self.eos = frozenset(hf_eos(file.parent) if eos is None else eos)

    def encode(self, text: str) -> list[int]:
        try:
            return self.tok.encode(text, add_special_tokens=self.special).ids
        except Exception as e:  # the Rust binding raises a bare Exception
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"the tokenizer {self.name} cannot encode {text[:40]!r} "
                             f"({reason}): use a prompt of its vocabulary") from None

    def decoder(self):
        """New ids -> the text they add (decoding the whole sequence so far, as
        byte-level BPE pieces join only in context); `final=True` at the end
        gives a character still split as U+FFFD, as transformers' decode does."""
        ids, said = [], ""

        def more(new, final=False):
            nonlocal said
            ids.extend(new)
            text = self.tok.decode(ids)
            if text.endswith("\ufffd") and not final:  # a character still split
                return ""
            out, said = text[len(said):], text
            return out
        return more


def hf_eos(directory: str | Path) -> list[int]:
    """An HF checkpoint's end-of-text id(s): its config.json's `eos_token_id`."""
    config = Path(directory) / "config.json"
    eos = json.loads(config.read_text()).get("eos_token_id") if config.is_file() else None
    return eos if isinstance(eos, list) else [] if eos is None else [eos]


def run_tokenizer(run_dir: str | Path, vocab_size: int, eos=None):
    """The tokenizer a run's data was made with: its tokenizer.json (encoding
    without special tokens, as a token file's text was), bytes for a
    byte-level model, else None (token ids without a tokenizer)."""
    tok = Path(run_dir) / "tokenizer.json"
    return (HFTokenizer(tok, eos=eos or [], special=False) if tok.is_file() else
            ByteTokenizer() if vocab_size == 256 else None)


__all__ = ["ByteTokenizer", "HFTokenizer", "hf_eos", "load_tokenizer", "run_tokenizer"]
