"""Bad input and faults, each tried as a user would: a fresh process, its exit
code, what it printed on stderr. `python tests/faults.py [NAME...]` runs the
list (or the cases whose names hold a NAME) and prints a table of case, exit
code, the stderr lines it says of the case (after generate.py's status lines),
the first of them and seconds; `tests/test_faults.py` holds each
case to what it must print.

Every case has one expected exit code (2 bad input, 3 a file could not be
written, 130 Ctrl-C, 0 where the input is legal) and, on stderr, exactly one
line starting with `first` (or nothing, `first=None`). The cases that make
a read-only or inode-less file system mount a tmpfs (root only; skipped
otherwise).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs import ROOT, SMALL, child_env  # noqa: E402

TRAIN, GENERATE = str(ROOT / "train.py"), str(ROOT / "generate.py")
# a small run: 2 fake devices, checkpoints at 2 and 4
BASE = ["--tp", "2", "--steps", "4", "--checkpoint-every", "2", *SMALL]


@dataclasses.dataclass
class Result:
    rc: int
    out: str
    err: str
    seconds: float

    @property
    def lines(self) -> list[str]:
        return self.err.strip().splitlines()


def run(*argv, cwd=None, env=None, timeout=300) -> Result:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-u", *map(str, argv)], capture_output=True, text=True,
                       cwd=cwd or ROOT, env=env or child_env(), timeout=timeout)
    return Result(r.returncode, r.stdout, r.stderr, time.perf_counter() - t0)


def started(*argv, until: str, stream: str = "stdout") -> tuple[subprocess.Popen, float]:
    """A process, once its `stream` has printed `until` (the rest of that
    stream is then read by `finish`). It takes SIGINT as from a terminal even
    where this process ignores it (a shell's background job does, the child
    would inherit that, and Python keeps an ignored SIGINT ignored)."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:  # see below: a handler here is SIG_DFL in the child
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-u", *map(str, argv)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT, env=child_env())
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    t0, pipe, seen = time.perf_counter(), getattr(proc, stream), ""
    while until not in seen:
        c = pipe.read(1)
        if not c:
            proc.kill()
            other = proc.stderr.read() if stream == "stdout" else ""
            raise AssertionError(f"exited {proc.wait()} before {until!r}: {seen[-1500:]} "
                                 f"{other[-1500:]}")
        seen += c
    proc.seen, proc.seen_on = seen, stream
    return proc, t0


def finish(proc: subprocess.Popen, t0: float, timeout=300) -> Result:
    out, err = proc.communicate(timeout=timeout)
    if proc.seen_on == "stdout":
        out = proc.seen + out
    else:
        err = proc.seen + err
    return Result(proc.returncode, out, err, time.perf_counter() - t0)


class Tmpfs:
    """A tmpfs mounted at `path` (root only), unmounted at exit."""

    def __init__(self, path: Path, *options: str):
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options or ("size=64m",)),
                        "tmpfs", str(path)], check=True, capture_output=True)
        self.path = path

    def read_only(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True,
                       capture_output=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


def can_mount() -> str | None:
    """Why tmpfs cases cannot run here, or None."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        return "needs root to mount a tmpfs"
    with tempfile.TemporaryDirectory() as d:
        try:
            Tmpfs(Path(d) / "m").__exit__()
        except subprocess.CalledProcessError:
            return "mount -t tmpfs is refused here"
    return None


# --- what the cases start from ------------------------------------------------

def base_run(work: Path) -> Path:
    """A finished 4-step run with checkpoints at 2 and 4 (made once per `work`)."""
    out = work / "base"
    if not (out / "checkpoints" / "4").is_dir():
        r = run(TRAIN, *BASE, "--out", out)
        assert r.rc == 0, r.err[-2000:]
    return out


def copy_run(work: Path, tmp: Path, name: str = "run") -> Path:
    shutil.copytree(base_run(work), tmp / name, symlinks=True)
    return tmp / name


def word_tokenizer(path: Path, unknown: bool = True) -> Path:
    """A WordLevel tokenizer.json of a few words (with or without an unknown token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>"] * unknown + ["<|endoftext|>", "def", "return", "x", "y", "(", ")", ":"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))  # absent without `unknown`
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def hf_checkpoint(path: Path, vocab: int = 64, positions: int = 64, eos: int | None = 1) -> Path:
    """A 1-layer Llama in Hugging Face's layout (random weights), no tokenizer.json."""
    import numpy as np
    from safetensors.numpy import save_file

    D, F, N, K, H = 32, 64, 4, 2, 8
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
          "hidden_size": D, "intermediate_size": F, "num_hidden_layers": 1,
          "num_attention_heads": N, "num_key_value_heads": K,
          "max_position_embeddings": positions,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
    if eos is not None:
        hf["eos_token_id"] = eos
    rng = np.random.default_rng(0)
    w = lambda *s: (rng.normal(size=s) * 0.1).astype(np.float32)
    p = "model.layers.0."
    tensors = {"model.embed_tokens.weight": w(vocab, D), "model.norm.weight": 1 + w(D),
               "lm_head.weight": w(vocab, D), p + "input_layernorm.weight": 1 + w(D),
               p + "post_attention_layernorm.weight": 1 + w(D),
               p + "self_attn.q_proj.weight": w(N * H, D),
               p + "self_attn.k_proj.weight": w(K * H, D),
               p + "self_attn.v_proj.weight": w(K * H, D),
               p + "self_attn.o_proj.weight": w(D, N * H), p + "mlp.gate_proj.weight": w(F, D),
               p + "mlp.up_proj.weight": w(F, D), p + "mlp.down_proj.weight": w(D, F)}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(path / "model.safetensors"))
    return path


# --- the cases ----------------------------------------------------------------

@dataclasses.dataclass
class Case:
    name: str
    go: Callable[[Path, Path], Result]  # (work dir shared by the cases, this case's dir)
    exit: int
    first: str | None  # stderr is this one line (its start), or empty
    check: Callable[[Path, Result], None] | None = None  # what else must hold
    mounts: bool = False  # needs a tmpfs
    slow: bool = True  # starts JAX (the argparse cases do not)
    status: bool = False  # stderr may also hold the tool's status lines (generate.py) first


def _flag(*argv):
    return lambda work, tmp: run(TRAIN, *argv)


def _second_writer(work, tmp):
    """A requeue that lands while the old job still runs (held still by
    SIGSTOP meanwhile, so that it is alive whatever the machine's speed)."""
    out = tmp / "run"
    first, t0 = started(TRAIN, "--tp", "2", "--steps", "12", "--checkpoint-every", "4",
                        *SMALL, "--out", out, until="step     3/")
    first.send_signal(signal.SIGSTOP)
    try:
        second = run(TRAIN, "--resume", "--out", out)
    finally:
        first.send_signal(signal.SIGCONT)
    first_done = finish(first, t0)
    assert first_done.rc == 0 and first_done.err == "", first_done.err[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13)), [r["step"] for r in rows]
    assert "resumed" not in first_done.out and not (out / "resumes.jsonl").exists()
    return second


def _read_only_run_dir(work, tmp):
    with Tmpfs(tmp / "fs") as fs:
        out = copy_run(work, fs.path)
        fs.read_only()
        r = run(TRAIN, "--resume", "--out", out, "--steps", "6")
    return r


def _checkpoints_fail(options: tuple[str, ...], read_only_after_first: bool):
    """The base run resumed with its checkpoints on a tmpfs of `options`:
    remounted read-only once a save there completed, or left to fail."""
    def go(work, tmp):
        out = copy_run(work, tmp)
        shutil.move(out / "checkpoints", tmp / "saved")
        with Tmpfs(out / "checkpoints", *options) as fs:
            shutil.copytree(tmp / "saved" / "4", fs.path / "4")  # the latest: 30 inodes
            # 100 steps between the remount and the failing save: the exit's
            # deadline holds on slower machines too (300 took 19 s on one)
            argv = [TRAIN, "--resume", "--out", out, "--steps", "4000", "--checkpoint-every",
                    "100" if read_only_after_first else "5"]
            if not read_only_after_first:
                return run(*argv)
            proc, t0 = started(*argv, until="step   101/")
            for _ in range(100):  # once step 100's save is complete and closed
                try:
                    if (fs.path / "100").is_dir():
                        fs.read_only()
                        break
                except subprocess.CalledProcessError:  # a file still open for writing
                    pass
                time.sleep(0.05)
            return finish(proc, time.perf_counter())  # seconds from the remount
    return go


def _exit_within(seconds):
    def check(tmp, r):
        assert r.seconds < seconds, f"took {r.seconds:.1f}s"
    return check


def _half_written_step(work, tmp):
    out = copy_run(work, tmp)
    cut = out / "checkpoints" / "6.orbax-checkpoint-tmp"
    shutil.copytree(out / "checkpoints" / "4", cut)
    shutil.rmtree(cut / "arrays")
    return run(TRAIN, "--resume", "--out", out, "--steps", "6")


def _row_cut_at_checkpoint(work, tmp):
    out = copy_run(work, tmp)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:-1]) + lines[-1][:20])  # row 4, cut
    return run(TRAIN, "--resume", "--out", out, "--steps", "5")


def _rows_complete(steps):
    def check(tmp, r):
        rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows] == steps, [x["step"] for x in rows]
    return check


def _hf_vocab(work, tmp):
    return run(TRAIN, "--init-from-hf", hf_checkpoint(tmp / "hf"), "--tp", "1", "--steps", "2",
               "--out", tmp / "run", "model.seq_len=32", "train.batch_size=2")


def _generate(*argv, tokenizer=None):
    def go(work, tmp):
        extra = ["--tokenizer", tokenizer(tmp)] if tokenizer else []
        return run(GENERATE, "--run", base_run(work), *argv, *extra)
    return go


def _garbage(tmp):
    (tmp / "garbage.json").write_text('{"version": "1.0", "model": ')
    return tmp / "garbage.json"


def _generate_ctrl_c(work, tmp):
    """Thousands of tokens from a 4096-position model: Ctrl-C once the text streams."""
    hf = hf_checkpoint(tmp / "hf", vocab=16, positions=4096, eos=None)  # no end of text
    proc, t0 = started(GENERATE, "--hf", hf, "--tokenizer", word_tokenizer(tmp / "words.json"),
                       "--prompt", "def x", "--max-new-tokens", "4000", "--temperature", "1",
                       until="def x")
    proc.send_signal(signal.SIGINT)
    return finish(proc, t0)


def _kept_text(tmp, r):
    assert r.out.startswith("def x") and r.out.endswith("\n"), r.out[:200]


def _hf_with_tokenizer_flag(work, tmp):
    return run(GENERATE, "--hf", hf_checkpoint(tmp / "hf", vocab=16), "--tokenizer",
               word_tokenizer(tmp / "words.json"), "--prompt", "def x", "--max-new-tokens",
               "3", "--temperature", "0")


def _text_alone_on_stdout(tmp, r):
    assert r.out.startswith("def ") and not any(
        w in r.out for w in ("accelerator", "loaded", "devices")), r.out[:300]
    assert any("devices" in line for line in r.lines), r.err


def _status_on_stderr(tmp, r):
    _text_alone_on_stdout(tmp, r)
    assert any(line.startswith("loaded ") for line in r.lines), r.err


def _prepare(*texts: str | bytes, out: str = "tokens.bin", tokenizer=None):
    def go(work, tmp):
        paths = []
        for i, t in enumerate(texts):
            paths.append(tmp / f"text{i}.txt")
            paths[-1].write_bytes(t if isinstance(t, bytes) else t.encode())
        (tmp / "dir.bin").mkdir()
        tok = tokenizer(tmp) if tokenizer else word_tokenizer(tmp / "words.json")
        return run("-m", "jaxtp.data", "prepare", "--tokenizer", tok, "--out", tmp / out,
                   *paths)
    return go


def _nothing_left(tmp, r):
    left = [p.name for p in tmp.iterdir() if p.name.endswith(".tmp")]
    assert not left, left


def _prepare_ctrl_c(work, tmp):
    text = tmp / "big.txt"
    text.write_text("def x ( y ) : return y\n" * 3_000_000)  # ~70 MB: seconds to tokenize
    proc, t0 = started("-m", "jaxtp.data", "prepare", "--tokenizer",
                       word_tokenizer(tmp / "words.json"), "--out", tmp / "tokens.bin", text,
                       until="tokens/s")  # its first progress line, after 2 s
    proc.send_signal(signal.SIGINT)
    return finish(proc, t0)


def _bad_dtype(work, tmp):
    from jaxtp.data import HEADER_BYTES, MAGIC

    body = json.dumps({"format": 1, "dtype": "object", "vocab_size": 256, "tokenizer": "x",
                       "tokenizer_sha256": "0", "eos_id": 0, "n_tokens": 10, "max_id": 9,
                       "documents": 1}).encode()
    (tmp / "tokens.bin").write_bytes(
        (MAGIC + len(body).to_bytes(4, "little") + body).ljust(HEADER_BYTES, b" ") + bytes(80))
    return run(TRAIN, "--tp", "1", "--steps", "1", "--data", tmp / "tokens.bin", "--out",
               tmp / "run")


def _plot(mutate, several=False):
    def go(work, tmp):
        a = copy_run(work, tmp / "tree1")
        dirs = [a] + ([copy_run(work, tmp / "tree2")] if several else [])
        mutate(a)
        (tmp / "here").mkdir()
        return run("-m", "jaxtp.plot", "runs", *dirs, cwd=tmp / "here")
    return go


def _damage_a_row(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:15]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _drawn_here(tmp, r):
    assert r.out.split() == ["wrote", str(tmp / "here" / "runs.png"),
                             "wrote", str(tmp / "here" / "runs.svg")], r.out


CASES = [
    # train.py
    Case("train: --inject-nan-at abc", _flag("--inject-nan-at", "abc"), 2,
         "train.py: error: argument --inject-nan-at: 'abc'", slow=False),
    Case("train: --peak-tflops -5", _flag("--peak-tflops", "-5"), 2,
         "train.py: error: argument --peak-tflops: '-5'", slow=False),
    Case("train: --peak-tflops nan", _flag("--peak-tflops", "nan"), 2,
         "train.py: error: argument --peak-tflops: 'nan'", slow=False),
    Case("train: --remat bogus", _flag("--remat", "bogus"), 2,
         "train.py: error: argument --remat: invalid choice: 'bogus'", slow=False),
    Case("train: --coordinator without a port",
         _flag("--tp", "2", "--coordinator", "nohost", "--num-processes", "2", "--process-id",
               "0"), 2, "error: coordinator 'nohost': expected HOST:PORT", slow=False),
    Case("train: warmup longer than the run",
         lambda work, tmp: run(TRAIN, "--tp", "1", "--steps", "3", *SMALL,
                               "train.warmup_steps=30", "--out", tmp / "run"), 0, None,
         lambda tmp, r: _said(r, "warning: train.warmup_steps=30 is not below train.steps=3")),
    Case("train: a second writer on a live run", _second_writer, 2,
         "error: --out "),
    Case("train: --resume on a read-only run directory", _read_only_run_dir, 3,
         "error: cannot write in the run directory ", mounts=True),
    Case("train: checkpoints turn read-only mid-run",
         _checkpoints_fail(("size=64m",), read_only_after_first=True), 3,
         "error: saving checkpoint step 200 in ", _exit_within(10), mounts=True),
    Case("train: no inodes left at a save's first file",
         _checkpoints_fail(("size=64m", "nr_inodes=40"), read_only_after_first=False), 3,
         "error: saving checkpoint step ", _exit_within(30), mounts=True),
    Case("train: resume over a half-written step", _half_written_step, 0, None),
    Case("train: the last row cut at a checkpointed step", _row_cut_at_checkpoint, 0, None,
         _rows_complete([1, 2, 3, 4, 5])),
    Case("train: --init-from-hf with data ids above its vocabulary", _hf_vocab, 2,
         "error: data has token id "),
    # generate.py
    Case("generate: Ctrl-C while generating", _generate_ctrl_c, 130, "stopped by Ctrl-C",
         _kept_text, status=True),
    Case("generate: a prompt the tokenizer cannot encode",
         _generate("--prompt", "zzz", tokenizer=lambda t: word_tokenizer(t / "w.json", False)),
         2, "error: the tokenizer "),
    Case("generate: a garbage --tokenizer", _generate("--prompt", "x", tokenizer=_garbage), 2,
         "error: tokenizer "),
    Case("generate: --tp 0", lambda work, tmp: run(GENERATE, "--run", tmp, "--tp", "0"), 2,
         "generate.py: error: argument --tp: '0': expected a positive int", slow=False),
    Case("generate: --hf without tokenizer.json, with --tokenizer", _hf_with_tokenizer_flag, 0,
         None, _text_alone_on_stdout, status=True),
    Case("generate: status on stderr, the text alone on stdout",
         _generate("--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0"), 0,
         None, _status_on_stderr, status=True),
    # python -m jaxtp.data prepare
    Case("prepare: a garbage tokenizer.json", _prepare("def x", tokenizer=_garbage), 2,
         "error: --tokenizer ", slow=False),
    Case("prepare: an empty text", _prepare(""), 2, "error: ", _nothing_left, slow=False),
    Case("prepare: text that is not UTF-8", _prepare("def x\n", b"def \xff\xfe x\n"), 2,
         "error: ", _nothing_left, slow=False),
    Case("prepare: --out an existing directory", _prepare("def x", out="dir.bin"), 2,
         "error: --out ", _nothing_left, slow=False),
    Case("prepare: Ctrl-C", _prepare_ctrl_c, 130, "stopped by Ctrl-C", _nothing_left),
    Case("prepare: a header dtype the format does not define", _bad_dtype, 2, "error: "),
    # python -m jaxtp.plot runs
    Case("plot: a damaged metrics line", _plot(_damage_a_row), 2, "error: "),
    Case("plot: runs in two trees", _plot(lambda d: None, several=True), 0, None, _drawn_here),
]


def _said(r: Result, text: str) -> None:
    assert text in r.out, r.out[-2000:]


def said(case: Case, r: Result) -> list[str]:
    """The stderr lines the tool says of the case: all of them, or for a tool
    that reports its status there, the last one of a failure."""
    return (r.lines[-1:] if r.rc else []) if case.status else r.lines


def check(case: Case, r: Result, tmp: Path) -> None:
    """Hold a result to its case (AssertionError naming what differs)."""
    assert r.rc == case.exit, f"exit {r.rc}, expected {case.exit}: {r.err[-2000:]}"
    lines = said(case, r)
    if case.first is None:
        assert lines == [], r.err[-2000:]
    else:
        assert len(lines) == 1 and lines[0].startswith(case.first), r.err[-2000:]
    if case.check:
        case.check(tmp, r)


def main(names: list[str]) -> int:
    cases = [c for c in CASES if not names or c.name in names or any(n in c.name for n in names)]
    why_not = can_mount()
    failed = 0
    print(f"{'case':58} {'exit':>4} {'lines':>5} {'s':>5}  first stderr line")
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        for i, case in enumerate(cases):
            if case.mounts and why_not:
                print(f"{case.name:58} skipped: {why_not}")
                continue
            tmp = work / f"case{i}"
            tmp.mkdir()
            r = case.go(work, tmp)
            try:
                check(case, r, tmp)
                verdict = ""
            except AssertionError as e:
                failed += 1
                verdict = f"  FAILED: {str(e)[:300]}"
            lines = said(case, r)
            first = lines[0][:110] if lines else "-"
            print(f"{case.name:58} {r.rc:>4} {len(lines):>5} {r.seconds:>5.1f}  "
                  f"{first}{verdict}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
