import numpy as np
import pytest

from jaxtp.train.data import Dataset, builtin_corpus, load_tokens, to_mesh
from jaxtp.parallel import make_mesh


def test_builtin_corpus_is_real_deterministic_text():
    a, b = builtin_corpus(), builtin_corpus()
    assert a.dtype == np.uint8 and len(a) > 1_000_000
    np.testing.assert_array_equal(a, b)
    assert b"def " in a[:200_000].tobytes() and b"import " in a[:200_000].tobytes()


def test_split_and_batches():
    ds = Dataset(np.arange(1000, dtype=np.uint16) % 50, seq_len=8, vocab_size=50)
    assert len(ds.train) == 900 and len(ds.val) == 100
    batch = next(ds.train_batches(4, seed=0))
    assert batch.shape == (4, 9) and batch.dtype == np.int32
    # windows are contiguous: each next token follows its predecessor
    assert np.all((batch[:, 1:] - batch[:, :-1]) % 50 == 1)
    np.testing.assert_array_equal(next(ds.train_batches(4, 0)), next(ds.train_batches(4, 0)))
    # a batch is read when asked, and any rows of it on their own
    np.testing.assert_array_equal(batch.rows(1, 3), np.asarray(batch)[1:3])
    ev = ds.eval_batches(2, 3)
    assert len(ev) == 3 and all(e.shape == (2, 9) for e in ev)
    assert all(set(e.ravel()) <= set(ds.val.tolist()) for e in ev)


def test_user_files(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("héllo wörld " * 100, encoding="utf-8")
    toks = load_tokens(str(txt))
    assert toks.tobytes().decode("utf-8") == "héllo wörld " * 100
    ids = np.array([1, 700, 3, 65535], dtype=np.uint16)
    (tmp_path / "t.bin").write_bytes(ids.tobytes())
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "t.bin")), ids)
    with pytest.raises(ValueError, match="token id 65535 but model.vocab_size=1000"):
        Dataset(np.tile(ids, 100), seq_len=4, vocab_size=1000)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="size 3 is odd"):
        load_tokens(str(tmp_path / "odd.bin"))
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_tokens(str(tmp_path / "bad.txt"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_tokens(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="fewer than model.seq_len"):
        Dataset(np.zeros(50, np.uint8), seq_len=64, vocab_size=256)


def test_batches_go_on_the_mesh_split_over_dp_replicated_over_tp():
    mesh = make_mesh(2, 4)
    x = to_mesh(np.arange(8 * 5, dtype=np.int32).reshape(8, 5), mesh)
    assert x.sharding.spec[0] == "dp"
    assert {s.data.shape for s in x.addressable_shards} == {(4, 5)}
