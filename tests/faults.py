"""Bad input and faults, each tried as a user would: a fresh process, its exit
code, what it printed on stderr. `python tests/faults.py [NAME...]` runs the
list (or the cases whose names hold a NAME) and prints a table of case, exit
code, the stderr lines it says of the case (after generate.py's status lines),
the first of them and seconds; `tests/test_faults.py` holds each
case to what it must print.

Every case has one expected exit code (2 bad input, 3 a file could not be
written, 130 Ctrl-C, 0 where the input is legal) and, on stderr, exactly one
line starting with `first` (or nothing, `first=None`; a save failing under
threads that race the exit: that line first, and no traceback). The cases
that make a read-only or inode-less file system mount a tmpfs (root only;
skipped otherwise).
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
import threading
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


def started(*argv, until: str, stream: str = "stdout",
            env=None) -> tuple[subprocess.Popen, float]:
    """A process, once its `stream` has printed `until` (the rest of that
    stream is then read by `finish`). It takes SIGINT as from a terminal even
    where this process ignores it (a shell's background job does, the child
    would inherit that, and Python keeps an ignored SIGINT ignored)."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:  # see below: a handler here is SIG_DFL in the child
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-u", *map(str, argv)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env or child_env())
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


def hf_checkpoint(path: Path, vocab: int = 64, positions: int = 64, eos: int | None = 1,
                  experts: int = 0, edit: Callable[[dict, dict], None] | None = None) -> Path:
    """A 1-layer Llama in Hugging Face's layout (random weights), no
    tokenizer.json; with `experts`, a Mixtral of that many (top-2); `edit`
    changes its config and tensors (dicts) before they are written."""
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
    if experts:
        hf |= {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
               "num_local_experts": experts, "num_experts_per_tok": 2}
        tensors = {k: v for k, v in tensors.items() if ".mlp." not in k}
        m = p + "block_sparse_moe."
        tensors[m + "gate.weight"] = w(experts, D)
        for j in range(experts):
            tensors |= {m + f"experts.{j}.w1.weight": w(F, D), m + f"experts.{j}.w3.weight":
                        w(F, D), m + f"experts.{j}.w2.weight": w(D, F)}
    if edit is not None:
        edit(hf, tensors)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _train_out(*argv):
    """train.py ARGV --out <the case's run>: a refusal must leave no run there."""
    return lambda work, tmp: run(TRAIN, *argv, "--out", tmp / "run")


def _no_run_dir(tmp, r):
    assert not (tmp / "run").exists(), sorted(p.name for p in (tmp / "run").iterdir())


def _done_line(*texts: str):
    """The run's last line says it is done, and `texts`."""
    def check(tmp, r):
        done = [line for line in r.out.splitlines() if line.startswith("done: ")]
        assert done and all(t in done[0] for t in texts), r.out[-2000:]
    return check


def _printed(text: str):
    def check(tmp, r):
        assert text in r.out, r.out[-2000:]
    return check


def _says(text: str):
    def check(tmp, r):
        assert text in r.lines[-1], r.lines
    return check


_ROUTER = "model.layers.0.block_sparse_moe.gate.weight"
_W1 = "model.layers.0.block_sparse_moe.experts.0.w1.weight"


def _nan_router(hf, tensors):
    tensors[_ROUTER][1, 2] = float("nan")


def _int_expert(hf, tensors):
    tensors[_W1] = (tensors[_W1] * 100).astype("int32")


def _no_experts(hf, tensors):
    hf["num_local_experts"] = 0


def _hf_moe(edit, tool: str = TRAIN, *argv):
    """--init-from-hf (or generate.py --hf) of a 4-expert Mixtral changed by `edit`."""
    def go(work, tmp):
        hf = hf_checkpoint(tmp / "hf", experts=4, edit=edit)
        if tool == GENERATE:
            return run(GENERATE, "--hf", hf, "--tokenizer", word_tokenizer(tmp / "words.json"),
                       "--prompt", "def x", "--max-new-tokens", "3", "--temperature", "0", *argv)
        return run(TRAIN, "--init-from-hf", hf, "--tp", "1", "--steps", "2", "--out",
                   tmp / "run", "model.seq_len=32", "train.batch_size=2", *argv)
    return go


def _holds_mixtral() -> str | None:
    """Why mixtral-8x7b's refusal cannot be seen here: a machine that holds its
    weights, gradients and Adam state (~750 GB) would start to train it."""
    from jaxtp.config import load_config
    from jaxtp.sizes import state_bytes
    from jaxtp.train.start import host_memory

    need = state_bytes(load_config("mixtral-8x7b"))
    return (f"this machine holds {host_memory() / 1e9:.0f} GB, more than mixtral-8x7b's "
            f"{need / 1e9:.0f} GB" if host_memory() >= need else None)


def _resumed_at_pp1(work, tmp):
    """A --pp 2 run (which chose 4 microbatches) stopped at step 2, resumed at --pp 1."""
    out = tmp / "run"
    first = run(TRAIN, "--pp", "2", "--tp", "1", "--steps", "3", "--until", "2", *SMALL,
                "--out", out)
    assert first.rc == 0 and "train.microbatches=4" in first.err, first.err[-2000:]
    return run(TRAIN, "--resume", "--out", out, "--pp", "1")


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
    # threads racing the exit (orbax's, TensorStore's) may print after `first`: it
    # is held to come first, and no traceback to appear
    racing: bool = False
    # why the case cannot run on this machine, or None
    unless: Callable[[], str | None] = lambda: None


def _flag(*argv):
    return lambda work, tmp: run(TRAIN, *argv)


def _second_writer(work, tmp):
    """A requeue that lands while the old job still runs (held still by
    SIGSTOP meanwhile, so that it is alive whatever the machine's speed).
    A device thread stopped mid-collective finds on SIGCONT that its peers'
    rendezvous took as long as the stop: XLA's CPU runtime warns after 20 s
    and aborts later, so the stopped process is given the stop's length
    (a busy machine's second process took over 20 s)."""
    out = tmp / "run"
    env = child_env()
    env["XLA_FLAGS"] += (" --xla_cpu_collective_call_warn_stuck_timeout_seconds=600"
                         " --xla_cpu_collective_call_terminate_timeout_seconds=1200")
    first, t0 = started(TRAIN, "--tp", "2", "--steps", "12", "--checkpoint-every", "4",
                        *SMALL, "--out", out, until="step     3/", env=env)
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


def _long_run(work: Path) -> Path:
    """The base run's model on a 4000-step schedule, stopped at step 4 with
    checkpoints at 2 and 4 (made once per `work`): a resume trains on without
    changing the schedule, so without the warning that would."""
    out = work / "long"
    if not (out / "checkpoints" / "4").is_dir():
        r = run(TRAIN, "--tp", "2", "--steps", "4000", "--until", "4", "--checkpoint-every",
                "2", *SMALL, "--out", out)
        assert r.rc == 0, r.err[-2000:]
    return out


def _checkpoints_fail(options: tuple[str, ...], read_only_after_first: bool):
    """The long run resumed with its checkpoints on a tmpfs of `options`:
    remounted read-only once its save of step 100 is complete (the save of
    step 200 fails), or left to fail. Its seconds count from the failing
    save on (`_from_failing_save`), not the start-up, compile and steps before."""
    def go(work, tmp):
        out = tmp / "run"
        shutil.copytree(_long_run(work), out, symlinks=True)
        shutil.move(out / "checkpoints", tmp / "saved")
        # "nr_inodes=left:N": the latest step's inodes and N more (how many
        # files orbax writes for a step varies with the load: ~30)
        need = 1 + sum(1 for _ in (tmp / "saved" / "4").rglob("*")) + 1
        opts = [f"nr_inodes={need + int(o.split(':')[1])}" if o.startswith("nr_inodes=left:")
                else o for o in options]
        with Tmpfs(out / "checkpoints", *opts) as fs:
            shutil.copytree(tmp / "saved" / "4", fs.path / "4")  # the latest
            proc = _stamped(TRAIN, "--resume", "--out", out,
                            "--checkpoint-every", "100" if read_only_after_first else "5")
            if read_only_after_first:
                _read_only_once_saved(proc, fs, "100")
            return _from_failing_save(proc)
    return go


def _stamped(*argv) -> subprocess.Popen:
    """A process whose stdout and stderr lines are read as they come, each
    with the time it arrived (`proc.stamped["out"]`, `["err"]`)."""
    proc = subprocess.Popen([sys.executable, "-u", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=child_env())
    proc.t0, proc.stamped = time.perf_counter(), {"out": [], "err": []}

    def read(pipe, into):
        for line in pipe:
            into.append((time.perf_counter(), line))
    proc.readers = [threading.Thread(target=read, args=(pipe, proc.stamped[k]), daemon=True)
                    for k, pipe in (("out", proc.stdout), ("err", proc.stderr))]
    for reader in proc.readers:
        reader.start()
    return proc


def _read_only_once_saved(proc: subprocess.Popen, fs: Tmpfs, step: str) -> None:
    """Remount `fs` read-only once `proc`'s save of `step` is complete (its
    directory in place, none of its files still open for writing)."""
    while proc.poll() is None and time.perf_counter() - proc.t0 < 300:
        try:
            if (fs.path / step).is_dir():
                fs.read_only()
                return
        except subprocess.CalledProcessError:  # a file still open for writing
            pass
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"step {step} was never saved (exit {proc.wait()})")


def _from_failing_save(proc: subprocess.Popen) -> Result:
    """`proc`'s result, its seconds counted from its log row of the step
    whose save failed (the loop prints it just before it saves) to its exit;
    from its start where no save is said to have failed."""
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    exited = time.perf_counter()
    for reader in proc.readers:
        reader.join()
    out, err = ("".join(line for _, line in proc.stamped[k]) for k in ("out", "err"))
    said = err.split("saving checkpoint step ")[1:2]
    row = f"step {said[0].split()[0]:>5}/" if said else None
    since = next((t for t, line in proc.stamped["out"] if row and line.startswith(row)), proc.t0)
    return Result(proc.returncode, out, err, exited - since)


def _exit_within(seconds):
    """A failing save stops the run within `seconds` (`_from_failing_save`):
    orbax's threads of a save that died at its directory would hold the
    exit ~300 s, and only train.py's `os._exit` cuts them short."""
    def check(tmp, r):
        assert r.seconds < seconds, f"exited {r.seconds:.1f}s after the failing save's row"
    return check


def _half_written_step(work, tmp):
    """The long run (no schedule change on resume) with its step 6 half-written."""
    out = tmp / "run"
    shutil.copytree(_long_run(work), out, symlinks=True)
    cut = out / "checkpoints" / "6.orbax-checkpoint-tmp"
    shutil.copytree(out / "checkpoints" / "4", cut)
    shutil.rmtree(cut / "arrays")
    return run(TRAIN, "--resume", "--out", out, "--until", "6")


def _row_cut_at_checkpoint(work, tmp):
    out = tmp / "run"
    shutil.copytree(_long_run(work), out, symlinks=True)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(lines[:-1]) + lines[-1][:20])  # row 4, cut
    return run(TRAIN, "--resume", "--out", out, "--until", "5")


def _status_said(r, *starts: str) -> None:
    """stderr is these status lines, in order, and nothing else."""
    assert len(r.lines) == len(starts) and all(
        line.startswith(s) for line, s in zip(r.lines, starts)), r.err[-2000:]


def _rows_complete(steps):
    def check(tmp, r):
        rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows] == steps, [x["step"] for x in rows]
    return check


def _overrides_around_flags(work, tmp):
    """The report's `model.n_layers=2 --steps 2 train.lr=1e-3`: overrides
    before, between and after the flags."""
    return run(TRAIN, "train.lr=1e-3", "--tp", "1", "--steps", "3", *SMALL, "--out",
               tmp / "run", "train.seed=3")


def _overrides_applied(tmp, r):
    cfg = json.loads((tmp / "run" / "config.json").read_text())
    got = (cfg["train"]["lr"], cfg["train"]["steps"], cfg["model"]["n_layers"],
           cfg["train"]["seed"])
    assert got == (1e-3, 3, 2, 3), got


def _rows_on_stdout(*steps):
    """The log's rows of `steps` on stdout, and no warning among them."""
    def check(tmp, r):
        assert all(f"step {s:>5}/" in r.out for s in steps), r.out[-2000:]
        assert not any(line.startswith("warning:") for line in r.out.splitlines()), r.out
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


def _token_file(edit: Callable[[dict], object], top: int = 99, *argv):
    """train.py on a token file of 5,000 ids up to `top`, its header a good
    one (vocabulary 384, max_id `top`) changed by `edit` (or replaced: any JSON)."""
    def go(work, tmp):
        import numpy as np

        from jaxtp.data import HEADER_BYTES, MAGIC

        ids = (np.arange(5000) % (top + 1)).astype("<u2")
        body = json.dumps(edit({
            "format": 1, "dtype": "uint16", "vocab_size": 384, "tokenizer": "x",
            "tokenizer_sha256": "0", "eos_id": 0, "n_tokens": ids.size, "max_id": top,
            "documents": 1})).encode()
        (tmp / "tokens.bin").write_bytes(
            (MAGIC + len(body).to_bytes(4, "little") + body).ljust(HEADER_BYTES, b" ")
            + ids.tobytes())
        return run(TRAIN, "--tp", "1", "--steps", "4", *SMALL, "model.vocab_size=384", *argv,
                   "--data", tmp / "tokens.bin", "--out", tmp / "run")
    return go


def _names_the_file(*texts: str):
    def check(tmp, r):
        line = r.lines[0]
        assert str(tmp / "tokens.bin") in line and all(t in line for t in texts), line
        # refused before the run directory is claimed: nothing to clear away
        assert not (tmp / "run").exists(), sorted(p.name for p in (tmp / "run").iterdir())
    return check


# a cluster file train.py --plan --cluster reads (jaxtp.analysis.cluster)
_CLUSTER = {"devices_per_node": 8, "nodes": 1,
            "accelerator": {"peak_flops": 1e15, "matmul_fraction": 0.8,
                            "hbm_bandwidth": 3e12, "memory": 8e10},
            "intra": {"bandwidth": 4e11, "latency": 2e-5},
            "inter": {"bandwidth": 4e10, "latency": 2.5e-5}}


def _plan_with_file(flag: str, content: bytes | dict):
    """train.py --plan FLAG FILE, the file holding `content` (bytes, or JSON)."""
    def go(work, tmp):
        path = tmp / "given.json"
        path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
        return run(TRAIN, "--plan", flag, path)
    return go


def _names_given(*texts: str):
    def check(tmp, r):
        line = r.lines[0]
        assert str(tmp / "given.json") in line and all(t in line for t in texts), line
    return check


def _bench(*argv):
    return lambda work, tmp: run("-m", "jaxtp.bench", *argv, "--out", tmp / "never")


def _wrote_nothing(tmp, r):
    assert not (tmp / "never").exists() and "Traceback" not in r.err, r.err[-2000:]


def _planned(*rows: str):
    def check(tmp, r):
        assert all(f"compiling the train step at {row} " in r.out for row in rows), r.out[-3000:]
    return check


# `python -c _LINGER SCRIPT ARGS`: SCRIPT ARGS with each array read that
# succeeds lingering 0.5 s (a shared file system), so that a restore failing
# at a damaged read leaves the others waiting: what a large model's restore
# does, and what a 2-core machine's small one does only now and then
_LINGER = """import asyncio, runpy, sys
from orbax.checkpoint._src.serialization import serialization
read = serialization._read_shard
async def lingering(*args, **kwargs):
    out = await read(*args, **kwargs)
    await asyncio.sleep(0.5)
    return out
serialization._read_shard = lingering
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _damaged_steps(*steps: int, generate: bool = False):
    """The base run with the array data of `steps` cut to half (a copy cut
    short), resumed by train.py or read by generate.py, reads lingering."""
    def go(work, tmp):
        out = copy_run(work, tmp)
        for s in steps:
            for f in (out / "checkpoints" / str(s) / "arrays" / "ocdbt.process_0" / "d").iterdir():
                os.truncate(f, f.stat().st_size // 2)
        if generate:
            return run("-c", _LINGER, GENERATE, "--run", out, "--prompt", "def ",
                       "--max-new-tokens", "2", "--temperature", "0")
        return run("-c", _LINGER, TRAIN, "--resume", "--out", out)
    return go


def _one_line_a_step(*steps: int, then: str | None = None):
    """One warning a damaged step (stdout or stderr), nothing from orbax's
    abandoned reads; stdout or stderr says `then`."""
    def check(tmp, r):
        assert "Traceback" not in r.err and "Exception ignored" not in r.err, r.err[:3000]
        warned = [line for line in (r.out + r.err).splitlines()
                  if line.startswith("WARNING: checkpoint step ")]
        assert [int(w.split()[3]) for w in warned] == list(steps), warned
        assert len(r.lines) <= len(steps) + 2, r.err[-3000:]  # + generate's status lines
        assert then is None or then in r.out + r.err, (r.out + r.err)[-3000:]
    return check


def _lock_not_a_file(make: Callable[[Path, Path], None]):
    """The base run resumed with its writer.lock made by `make(lock, tmp)`."""
    def go(work, tmp):
        out = copy_run(work, tmp)
        (out / "writer.lock").unlink()
        make(out / "writer.lock", tmp)
        return run(TRAIN, "--resume", "--out", out)
    return go


def _lock_to_elsewhere(lock: Path, tmp: Path) -> None:
    (tmp / "elsewhere.txt").write_text("not the run's\n")
    lock.symlink_to(tmp / "elsewhere.txt")


def _lock_named(kind: str, untouched: bool = False):
    def check(tmp, r):
        assert f"{tmp / 'run' / 'writer.lock'} is {kind}" in r.lines[0], r.lines[0]
        assert not untouched or (tmp / "elsewhere.txt").read_text() == "not the run's\n"
    return check


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
                               "train.warmup_steps=30", "--out", tmp / "run"), 0,
         "warning: train.warmup_steps=30 is not below train.steps=3", _rows_on_stdout(1, 3)),
    Case("train: a second writer on a live run", _second_writer, 2,
         "error: --out "),
    Case("train: --resume on a read-only run directory", _read_only_run_dir, 3,
         "error: cannot write in the run directory ", mounts=True),
    Case("train: checkpoints turn read-only mid-run",
         _checkpoints_fail(("size=64m",), read_only_after_first=True), 3,
         "error: saving checkpoint step 200 in ", _exit_within(60), mounts=True, racing=True),
    Case("train: no inodes left at a save's first file",
         _checkpoints_fail(("size=64m", "nr_inodes=left:8"), read_only_after_first=False), 3,
         "error: saving checkpoint step ", _exit_within(60), mounts=True, racing=True),
    # (--until: a status line on stderr, where the run stands)
    Case("train: resume over a half-written step", _half_written_step, 0, None,
         lambda tmp, r: _status_said(r, "note: step 6 in ", "stopped after step 6 (--until)"),
         status=True),
    Case("train: the last row cut at a checkpointed step", _row_cut_at_checkpoint, 0, None,
         lambda tmp, r: (_rows_complete([1, 2, 3, 4, 5])(tmp, r),
                         _status_said(r, "stopped after step 5 (--until)")), status=True),
    Case("train: --init-from-hf with data ids above its vocabulary", _hf_vocab, 2,
         "error: data has token id "),
    # the train CLI (issue 42)
    Case("train: --config ''", _flag("--config", ""), 2, "config error: config '' not found",
         slow=False),
    Case("train: overrides on both sides of a flag", _overrides_around_flags, 0, None,
         _overrides_applied),
    Case("train: an unknown flag among overrides",
         _flag("model.n_layers=2", "--bogus", "3", "train.lr=1e-3"), 2,
         "train.py: error: unrecognized arguments: --bogus", slow=False),
    Case("train: a bad override after a flag",
         _flag("model.d_model=64", "--steps", "2", "model.n_layers=0"), 2,
         "config error: model.n_layers=0 must be positive", slow=False),
    Case("train: a warning on stderr, the rows on stdout",
         lambda work, tmp: run(TRAIN, "--resume", "--out", copy_run(work, tmp), "--steps", "6"),
         0, "warning: the lr schedule now spans 6 steps", _rows_on_stdout(5, 6)),
    # plans, clusters, configs, bench (issue 42)
    Case("plan: a --cluster file holding 5", _plan_with_file("--cluster", b"5"), 2,
         "config error: ", _names_given("a cluster is a JSON object", "not 5"), slow=False),
    Case("plan: a --cluster file holding null", _plan_with_file("--cluster", b"null"), 2,
         "config error: ", _names_given("not null"), slow=False),
    Case("plan: a --cluster file that is not UTF-8",
         _plan_with_file("--cluster", b'{"nodes": 1\xff}'), 2, "config error: ",
         _names_given("not UTF-8 text (byte 0xff at offset 11)"), slow=False),
    Case("plan: a misspelt cluster field (gpus_per_node)",
         _plan_with_file("--cluster", _CLUSTER | {"gpus_per_node": 8}), 2, "config error: ",
         _names_given("unknown field 'gpus_per_node' (did you mean 'devices_per_node'?)"),
         slow=False),
    Case("plan: a misspelt link field (per_hops)",
         _plan_with_file("--cluster", _CLUSTER | {"intra": _CLUSTER["intra"] | {
             "per_hops": True}}), 2, "config error: ",
         _names_given("intra: unknown field 'per_hops' (did you mean 'per_hop'?)"),
         slow=False),
    Case("plan: --cluster ''", _flag("--plan", "--cluster", ""), 2,
         "config error: --cluster '' is empty: name a preset (h100x8, ", slow=False),
    Case("plan: a --config file that is not UTF-8",
         _plan_with_file("--config", b'{"model": {}}\xfe'), 2, "config error: ",
         _names_given("is not UTF-8 text (byte 0xfe at offset 13)"), slow=False),
    Case("plan: --cp-attention ring at cp=1", _flag("--plan", "--cp-attention", "ring"), 2,
         "config error: parallel.cp_attention='ring' (--cp-attention ring) passes K/V chunks "
         "between the cp ranks, and parallel.cp=1 has none: add --cp N", slow=False),
    Case("plan: --cp 3 plans cp=3",
         _flag("--plan", "--cp", "3", "model.seq_len=96", "model.n_layers=1",
               "train.batch_size=2"), 0, None, _planned("cp=1 tp=1", "cp=2 tp=1", "cp=3 tp=1")),
    Case("bench: --only ''", _bench("--only", ""), 2,
         "error: --only '': an empty section name; give sections separated by commas",
         _wrote_nothing, slow=False),
    Case("bench: --gpu without a GPU", _bench("--gpu"), 2,
         "error: --gpu times training on a GPU, and none was found: jax.devices()[0] is cpu",
         _wrote_nothing, slow=False),
    # checkpoints and the lock (issue 42)
    Case("train: --resume with every checkpoint step damaged", _damaged_steps(4, 2), 1,
         "error: no usable checkpoint in ", _one_line_a_step(4, 2), status=True),
    Case("train: --resume with the latest checkpoint step damaged", _damaged_steps(4), 0,
         None, _one_line_a_step(4, then="checkpoints step 2 (saved "), status=True),
    Case("generate: the latest checkpoint step damaged", _damaged_steps(4, generate=True), 0,
         None, _one_line_a_step(4, then=" step 2 at tp=2"), status=True),
    Case("train: writer.lock a directory",
         _lock_not_a_file(lambda lock, tmp: lock.mkdir()), 2,
         "error: the run's writer lock ", _lock_named("a directory")),
    Case("train: writer.lock a symbolic link", _lock_not_a_file(_lock_to_elsewhere), 2,
         "error: the run's writer lock ", _lock_named("a symbolic link to ", untouched=True)),
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
    # token files (issue 42)
    Case("train: a token file whose header understates max_id",
         _token_file(lambda h: {**h, "max_id": 100}, 1999), 2,
         "error: data has token id ",
         _names_the_file("but model.vocab_size=384 (", "header says its largest id is 100",
                         "prepare it again")),
    Case("train: a token file header that is a JSON list", _token_file(list), 2, "error: ",
         _names_the_file("header is an array, not a JSON object")),
    Case("train: a token file header with a string vocab_size",
         _token_file(lambda h: {**h, "vocab_size": "384"}), 2, "error: ",
         _names_the_file('vocab_size is the string "384", not an integer >= 1')),
    Case("train: a token file header without n_tokens",
         _token_file(lambda h: {k: v for k, v in h.items() if k != "n_tokens"}), 2, "error: ",
         _names_the_file("header has no n_tokens (the format wants an integer >= 0)")),
    Case("train: a token file header with a string n_tokens",
         _token_file(lambda h: {**h, "n_tokens": "5000"}), 2, "error: ",
         _names_the_file('n_tokens is the string "5000", not an integer >= 0')),
    # issue 64: finished runs exit 0, every key in range before anything is written,
    # Hugging Face tensors checked, nothing past what any machine holds compiled
    # (one process for two rows of the issue: a 3-step smoke run of a config's
    # 30-step warmup, which said so on stderr, whose first and last rows are skipped)
    Case("train: a smoke run, its first and last logged steps skipped",
         lambda work, tmp: run(TRAIN, "--tp", "2", "--steps", "3", *[
             a for a in SMALL if not a.startswith("train.warmup_steps")], "--inject-nan-at",
             "1,3", "--out", tmp / "run"), 0, None,
         lambda tmp, r: (_done_line("loss ", "(2 steps skipped)")(tmp, r),
                         _rows_on_stdout(1, 2, 3)(tmp, r))),
    Case("train: moe_balance_coef nan",
         _train_out("--config", "moe-tiny", "model.moe_balance_coef=nan", "--steps", "2"), 2,
         "config error: model.moe_balance_coef=nan must be finite and >= 0", _no_run_dir,
         slow=False),
    Case("train: parallel.ep=-2", _train_out("--config", "moe-tiny", "parallel.ep=-2"), 2,
         "config error: parallel.ep=-2 must be positive", _no_run_dir, slow=False),
    Case("train: --ep -2", _train_out("--config", "moe-tiny", "--ep", "-2"), 2,
         "config error: parallel.ep=-2 must be positive", _no_run_dir, slow=False),
    Case("train: --ep 0", _train_out("--config", "moe-tiny", "--ep", "0"), 2,
         "config error: parallel.ep=0 must be positive", _no_run_dir, slow=False),
    Case("train: moe_z_coef=-1", _train_out("--config", "moe-tiny", "model.moe_z_coef=-1"), 2,
         "config error: model.moe_z_coef=-1.0 must be finite and >= 0", _no_run_dir,
         slow=False),
    Case("train: capacity_factor=inf",
         _train_out("--config", "moe-tiny", "model.capacity_factor=inf"), 2,
         "config error: model.capacity_factor=inf must be finite and >= 0", _no_run_dir,
         slow=False),
    Case("train: --capacity-factor nan", _train_out("--config", "moe-tiny", "--capacity-factor",
                                                    "nan"), 2,
         "config error: model.capacity_factor=nan must be finite and >= 0", _no_run_dir,
         slow=False),
    Case("train: n_experts=-8", _train_out("--config", "moe-tiny", "model.n_experts=-8"), 2,
         "config error: model.n_experts=-8 must be >= 0 (0: dense MLPs)", _no_run_dir,
         slow=False),
    Case("train: moe_d_ff=-5", _train_out("--config", "moe-tiny", "model.moe_d_ff=-5"), 2,
         "config error: model.moe_d_ff=-5 must be >= 0", _no_run_dir, slow=False),
    Case("train: --capacity-factor on a dense model", _train_out("--capacity-factor", "1.25"), 2,
         "config error: model.capacity_factor=1.25 (--capacity-factor 1.25) acts on a mixture "
         "of experts, and model.n_experts=0 has none", _no_run_dir, slow=False),
    Case("train: --pp-schedule 1f1b without --pp", _train_out("--tp", "8", "--pp-schedule",
                                                              "1f1b"), 2,
         "config error: parallel.pp_schedule='1f1b' (--pp-schedule 1f1b) orders a pipeline's "
         "microbatches, and parallel.pp=1 has no stages: add --pp N", _no_run_dir, slow=False),
    Case("train: a refused --pp says no microbatches", _train_out("--pp", "3"), 2,
         "config error: pipeline parallelism splits model.n_layers=4 evenly over pp=3",
         _no_run_dir, slow=False),
    Case("train: a misspelt key", _train_out("model.d_modle=64"), 2,
         "config error: unknown config key 'model.d_modle'; did you mean model.d_model?",
         _no_run_dir, slow=False),
    Case("train: --resume at --pp 1 of a --pp 2 run", _resumed_at_pp1, 0,
         "note: --pp 1 keeps the run's train.microbatches=4",
         lambda tmp, r: _rows_on_stdout(3)(tmp, r) or _printed(
             "(saved at pp=2 x dp=1 x tp=1; now dp=1 x tp=1)")(tmp, r)),
    Case("train: --init-from-hf of a Mixtral whose router holds a NaN", _hf_moe(_nan_router), 2,
         f"error: checkpoint tensor {_ROUTER} holds 1 non-finite value(s)", _no_run_dir),
    Case("train: --init-from-hf of an int32 expert tensor", _hf_moe(_int_expert), 2,
         f"error: checkpoint tensor {_W1} is int32, not a floating-point weight", _no_run_dir),
    Case("train: --init-from-hf of a Mixtral of 0 experts", _hf_moe(_no_experts), 2,
         "config error: ", lambda tmp, r: (_no_run_dir(tmp, r), _says(
             "config.json: num_local_experts=0: a Mixtral config names its experts")(tmp, r)),
         slow=False),
    Case("generate: --hf of a Mixtral whose router holds a NaN", _hf_moe(_nan_router, GENERATE),
         2, f"error: checkpoint tensor {_ROUTER} holds 1 non-finite value(s)", status=True),
    Case("generate: --hf --tp 3 offers only what the model splits into",
         _hf_moe(None, GENERATE, "--tp", "3"), 2,
         "error: model.moe_d_ff (0: model.d_ff)=64 is not divisible by tp=3; choose --tp from "
         "[1, 2, 4] ",
         status=True),
    Case("generate: --hf a missing directory",
         lambda work, tmp: run(GENERATE, "--hf", tmp / "nowhere", "--prompt", "x"), 2,
         "error: --hf ", _says("no such directory"), slow=False),
    Case("plan: model.n_layers=10**20", _flag("--plan", "--tp", "8", f"model.n_layers={10**20}"),
         2, f"config error: model.n_layers={10**20} is past the largest size", slow=False),
    Case("plan: train.batch_size=10**21",
         _flag("--plan", "--tp", "8", f"train.batch_size={10**21}"), 2,
         f"config error: train.batch_size={10**21} is past the largest size", slow=False),
    Case("plan: 10**9 layers, more than any accelerator holds",
         _flag("--plan", "--tp", "8", "model.n_layers=1000000000"), 2,
         "error: the model's weights, gradients and Adam state"),
    Case("train: mixtral-8x7b on this machine", _train_out("--config", "mixtral-8x7b"), 2,
         "error: the model's weights, gradients and Adam state", _no_run_dir,
         unless=_holds_mixtral),
    # python -m jaxtp.plot runs
    Case("plot: a damaged metrics line", _plot(_damage_a_row), 2, "error: "),
    Case("plot: runs in two trees", _plot(lambda d: None, several=True), 0, None, _drawn_here),
]


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
    elif case.racing:
        assert lines[:1] and lines[0].startswith(case.first), r.err[-2000:]
        assert "Traceback" not in r.err, r.err[-2000:]
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
            why = why_not if case.mounts else case.unless()
            if why:
                print(f"{case.name:58} skipped: {why}")
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
