"""Token files: a tokenizer built here (no download) -> prepare -> memmap ->
batches -> decode gives the text back; uint32 ids; every refusal."""

import json

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="pip install -e '.[data]'")

from jaxtp import data as token_files  # noqa: E402
from jaxtp.data.__main__ import main as data_main  # noqa: E402
from jaxtp.train.data import Dataset, load_tokens  # noqa: E402

TEXT = ["def add(a, b):\n    return a + b\n" * 40, "class Point:\n    x: int = 0\n" * 40]


def bpe(tmp_path, vocab: int = 300):
    """A byte-level BPE trained on TEXT, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def texts(tmp_path):
    paths = []
    for i, t in enumerate(TEXT):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text(t)
    return paths


def test_prepare_memmap_batches_decode_round_trip(tmp_path, capsys):
    tok_path = bpe(tmp_path)
    out = tmp_path / "corpus.tokens"
    assert data_main(["prepare", "--tokenizer", str(tmp_path), "--out", str(out),
                      *map(str, texts(tmp_path))]) == 0
    assert "tokens/s" in capsys.readouterr().out
    tokens, header = token_files.read_tokens(out)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    tok = tokenizers.Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id("<|endoftext|>")
    assert header["eos_id"] == eos and header["documents"] == 2
    assert header["n_tokens"] == tokens.size and header["max_id"] == int(tokens.max())
    # documents, each followed by EOS; decoding gives the text back
    ends = np.flatnonzero(np.asarray(tokens) == eos)
    assert list(ends) == [ends[0], tokens.size - 1]
    assert tok.decode(list(tokens[:ends[0]])) == TEXT[0]
    assert tok.decode(list(tokens[ends[0] + 1:-1])) == TEXT[1]
    # train.py's reader maps the same ids, and batches are windows of them
    ids = load_tokens(str(out))
    assert isinstance(ids, np.memmap) and np.array_equal(ids, tokens)
    ds = Dataset(ids, 16, 300, max_id=header["max_id"])
    batch = next(ds.train_batches(4, seed=0))
    for row, start in zip(np.asarray(batch), batch.starts):  # contiguous windows of the file
        assert np.array_equal(row, tokens[start:start + 17])
    assert json.loads((tmp_path / "corpus.tokens.tokenizer.json").read_text()) == \
        json.loads(tok_path.read_text())


def words(tmp_path):
    """A word-level tokenizer of 70,002 ids: w0 .. w69999, [UNK], </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_a_vocabulary_over_65535_ids_is_stored_as_uint32(tmp_path):
    (tmp_path / "t.txt").write_text("w1 w69999 w65536 w7\n")
    header = token_files.prepare(words(tmp_path), tmp_path / "big.tokens",
                                 [tmp_path / "t.txt"], log=lambda _: None)
    tokens = load_tokens(str(tmp_path / "big.tokens"))
    assert header["dtype"] == "uint32" and tokens.dtype == np.uint32
    assert list(tokens) == [1, 69_999, 65_536, 7, 70_001]


def test_a_model_vocabulary_smaller_than_the_tokenizers_is_refused(tmp_path, capsys):
    import train

    (tmp_path / "t.txt").write_text(" ".join(f"w{i % 200}" for i in range(5000)))
    out = tmp_path / "w.tokens"
    token_files.prepare(words(tmp_path), out, [tmp_path / "t.txt"], eos="w199",
                        log=lambda _: None)
    # every id the data holds is below 256, but the tokenizer has 70,002
    assert train.main(["--data", str(out), "--out", str(tmp_path / "run"), "--steps", "1",
                       "model.seq_len=32"]) == 2
    err = capsys.readouterr().err
    assert "70,002-id vocabulary (tokenizer.json), larger than model.vocab_size=256" in err
    assert not (tmp_path / "run").exists()


def test_refusals_are_clear(tmp_path):
    tok_path = bpe(tmp_path)
    docs = list(map(str, texts(tmp_path)))
    out = tmp_path / "c.tokens"
    token_files.prepare(tok_path, out, docs, log=lambda _: None)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        token_files.prepare(tmp_path / "nowhere", out, docs)
    with pytest.raises(ValueError, match="has no '<none>' token"):
        token_files.prepare(tok_path, out, docs, eos="<none>")
    with pytest.raises(FileNotFoundError, match="missing.txt: no such file"):
        token_files.prepare(tok_path, out, [str(tmp_path / "missing.txt")])
    cut = tmp_path / "cut.tokens"
    cut.write_bytes(out.read_bytes()[:-7])
    with pytest.raises(ValueError, match="a truncated copy"):
        load_tokens(str(cut))
    with pytest.raises(ValueError, match="data has token id"):
        Dataset(load_tokens(str(out)), 8, 100, max_id=token_files.read_header(out)["max_id"])


GOOD = {"format": 1, "dtype": "uint16", "vocab_size": 384, "tokenizer": "tokenizer.json",
        "tokenizer_sha256": "0", "eos_id": 0, "n_tokens": 10, "max_id": 9, "documents": 1}


def token_file(path, header, ids=np.arange(10, dtype="<u2")):
    """A token file of `ids` under `header` (any JSON value), as prepare lays one out."""
    body = json.dumps(header).encode()
    path.write_bytes((token_files.MAGIC + len(body).to_bytes(4, "little") + body)
                     .ljust(token_files.HEADER_BYTES, b" ") + ids.tobytes())
    return path


@pytest.mark.parametrize("header, said", [
    (list(GOOD), "is an array, not a JSON object of its fields"),
    ("header", 'is the string "header", not a JSON object of its fields'),
    ({**GOOD, "vocab_size": "384"}, 'vocab_size is the string "384", not an integer >= 1'),
    ({k: v for k, v in GOOD.items() if k != "n_tokens"},
     "has no n_tokens (the format wants an integer >= 0)"),
    ({**GOOD, "n_tokens": "10"}, 'n_tokens is the string "10", not an integer >= 0'),
    ({**GOOD, "n_tokens": -10}, "n_tokens is the integer -10, not an integer >= 0"),
    ({**GOOD, "n_tokens": 10.0}, "n_tokens is the number 10.0, not an integer >= 0"),
    ({**GOOD, "max_id": True}, "max_id is the boolean true, not an integer >= 0"),
    ({**GOOD, "vocab_size": 0}, "vocab_size is the integer 0, not an integer >= 1"),
    ({**GOOD, "eos_id": None}, "eos_id is null, not an integer >= 0"),
    ({**GOOD, "tokenizer": ["a"]}, "tokenizer is an array, not a string"),
    ({**GOOD, "format": 2}, "format is the integer 2, not 1"),
    ({**GOOD, "format": "1"}, 'format is the string "1", not 1'),
    ({**GOOD, "dtype": "object"}, "dtype is the string \"object\", not 'uint16' or 'uint32'"),
    ({**GOOD, "n_tokens": "x" * 100}, 'n_tokens is the string "' + "x" * 36 + '..., not'),
])
def test_a_header_is_checked_field_by_field_naming_the_file(tmp_path, header, said):
    path = token_file(tmp_path / "t.tokens", header)
    with pytest.raises(ValueError) as e:
        load_tokens(str(path))
    assert str(e.value).startswith(f"{path}: its token file header {said}")
    assert str(e.value).endswith("; prepare it again with python -m jaxtp.data prepare")
    assert "\n" not in str(e.value)
    assert token_files.read_header(token_file(tmp_path / "good.tokens", GOOD)) == GOOD


def test_a_header_that_understates_max_id_stops_at_the_batch_that_holds_the_id(tmp_path):
    ids = (np.arange(5000) % 100).astype("<u2")
    ids[[1000, 4500]] = 1999, 2000  # in the train split; the validation split's first id
    path = token_file(tmp_path / "t.tokens", {**GOOD, "n_tokens": 5000, "max_id": 99}, ids)
    ds = Dataset(load_tokens(str(path)), 16, 384, max_id=token_files.read_header(path)["max_id"])
    with pytest.raises(ValueError) as e:
        ds.eval_batches(2, 1)
    assert str(e.value) == (f"data has token id 2000 but model.vocab_size=384 ({path}, whose "
                            "header says its largest id is 99): the file is damaged; prepare "
                            "it again with python -m jaxtp.data prepare")
    batches, read = ds.train_batches(4, seed=0), 0
    while True:  # batches read as ever, until the first window that holds token 1000
        batch = next(batches)
        holds = (batch.starts <= 1000) & (1000 <= batch.starts + 16)
        if holds.any():
            break
        read += np.asarray(batch).shape[0]
    assert read > 0
    with pytest.raises(ValueError, match="data has token id 1999 but model.vocab_size=384"):
        np.asarray(batch)
    for i in np.flatnonzero(~holds):  # a process reads only its rows: the others' are fine
        assert batch.rows(i, i + 1).max() < 100


@pytest.mark.slow
def test_train_on_a_token_file_then_generate_with_its_tokenizer(tmp_path, capsys):
    import generate
    import train

    bpe(tmp_path)
    out = tmp_path / "c.tokens"
    token_files.prepare(tmp_path, out, list(map(str, texts(tmp_path))), log=lambda _: None)
    run = tmp_path / "run"
    small = ["model.n_layers=1", "model.d_model=32", "model.n_heads=4", "model.d_ff=64",
             "model.seq_len=32", "train.batch_size=8", "train.log_every=10"]
    # a vocabulary below the data's largest id is refused before anything is written
    assert train.main(["--tp", "2", "--data", str(out), "--out", str(run), "--steps", "3",
                       "model.vocab_size=256", *small]) == 2
    assert "data has token id 286 but model.vocab_size=256" in capsys.readouterr().err
    assert not run.exists()
    assert train.main(["--tp", "2", "--data", str(out), "--out", str(run), "--steps", "30",
                       "model.vocab_size=300", *small]) == 0
    assert (run / "tokenizer.json").is_file()
    capsys.readouterr()
    assert generate.main(["--run", str(run), "--prompt", "def add", "--temperature", "0",
                          "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    sample = printed[printed.index("def add"):]
    assert len(sample) > len("def add")
    eos = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")).token_to_id(
        "<|endoftext|>")
    assert json.loads((run / "launch.json").read_text())["eos"] == [eos]


def test_streamed_text_holds_back_a_split_character(tmp_path):
    from jaxtp.data.tokenizer import HFTokenizer

    tok = HFTokenizer(bpe(tmp_path), eos=[], special=False)
    ids = tok.encode("café ok")
    more = tok.decoder()
    pieces = [more([i]) for i in ids]  # é is two byte-level tokens
    assert "".join(pieces) == "café ok" and "\ufffd" not in "".join(pieces)


def test_a_character_still_split_at_the_end_is_a_replacement_character(tmp_path):
    """At the end of the stream (`final=True`) the bytes of a character not yet
    whole come out as U+FFFD, as a whole decode gives them (they were dropped)."""
    from jaxtp.data.tokenizer import ByteTokenizer, HFTokenizer

    tok = HFTokenizer(bpe(tmp_path), eos=[], special=False)
    ids = tok.encode("café")
    cut = ids[:-1]  # é's first byte-level token only
    more = tok.decoder()
    text = "".join(more([i]) for i in cut) + more([], final=True)
    assert text == tok.tok.decode(cut) and text.endswith("\ufffd"), text
    more = ByteTokenizer().decoder()
    text = more(list("caf".encode())) + more(["é".encode()[0]]) + more([], final=True)
    assert text == "caf\ufffd" == (b"caf" + "é".encode()[:1]).decode("utf-8", "replace")
