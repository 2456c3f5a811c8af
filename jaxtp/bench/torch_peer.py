"""A PyTorch reference for the CPU: the same GPT-2 train step in PyTorch eager
(`python -m jaxtp.bench --only torch-peer`), where `torch` is importable.
torch is never a dependency of jaxtp: without it the section says so.

Same shapes, initialisation scheme, dtype (fp32) and optimizer as a jaxtp
`gpt2` config at tp=1: pre-norm blocks, a fused qkv projection, causal
attention (`scaled_dot_product_attention`, PyTorch's fused kernel), tanh
GELU, a tied head over the padded table (padding logits masked), mean
cross-entropy, global-norm clipping and decoupled weight decay on matrices
(AdamW).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np

from ..config import Config
from .timing import build, paired_ratio, time_alternating


def available() -> str | None:
    """None where torch imports, else why not."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        return f"torch is not installed ({e}); pip install torch to time it"
    return None


def describe() -> str:
    import torch

    return f"PyTorch {torch.__version__} eager, {torch.get_num_threads()} threads"


def _model(cfg: Config):
    """The GPT-2 of `cfg` as a torch module (seeded with train.seed)."""
    import torch
    from torch import nn

    m, t = cfg.model, cfg.train
    torch.manual_seed(t.seed)
    D, N, L, V = m.d_model, m.n_heads, m.n_layers, m.padded_vocab

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D, eps=m.ln_eps), nn.LayerNorm(D, eps=m.ln_eps)
            self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.up, self.down = nn.Linear(D, m.d_ff), nn.Linear(m.d_ff, D)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, N, D // N).permute(2, 0, 3, 1, 4)
            o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(o.transpose(1, 2).reshape(B, T, D))
            return x + self.down(nn.functional.gelu(self.up(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(m.seq_len, D)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(D, eps=m.ln_eps)
            for name, p in self.named_parameters():
                if p.dim() > 1:  # GPT-2's init: residual outputs scaled by 1/sqrt(2L)
                    std = m.init_std / (math.sqrt(2 * L) if name.endswith(("out.weight",
                                                                            "down.weight"))
                                        else 1)
                    nn.init.normal_(p, std=std)
                elif name.endswith("bias") and "ln" not in name:
                    nn.init.zeros_(p)

        def forward(self, x, y):
            h = self.wte(x) + self.wpe.weight[: x.shape[1]]
            for b in self.blocks:
                h = b(h)
            logits = self.ln_f(h) @ self.wte.weight.T
            logits[..., m.vocab_size:] = float("-inf")
            return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    return GPT()


def make_step(cfg: Config):
    """A callable running one PyTorch train step on a fixed batch (returns the loss)."""
    import torch
    from torch import nn

    m, t = cfg.model, cfg.train
    model = _model(cfg)
    # jaxtp's decay: matrices and tables, not biases or norm scales
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1]},
              {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.b1, t.b2), weight_decay=t.weight_decay)
    # the batch `jaxtp.bench.timing.build` draws for jaxtp's step
    tokens = torch.from_numpy(np.random.default_rng(0).integers(
        0, m.vocab_size, (t.batch_size, m.seq_len + 1)))

    def step():
        loss = model(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if t.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        return loss.detach().item()

    return step


def timed(run, cfg: Config, warmup: int, rounds: int) -> dict:
    """jaxtp's built step `run` (`jaxtp.bench.timing.build`) against PyTorch
    eager's of `cfg`, one step each per round, the order reversed every
    other round: each side's tokens/s (from its median step) and the paired
    ratio of jaxtp's tokens/s to PyTorch's (median, min, max over rounds)."""
    step = make_step(cfg)

    class Torch:
        name = "PyTorch eager"

        def __call__(self):
            return step()

    t = time_alternating([run, Torch()], warmup, rounds)
    ratio, lo, hi = paired_ratio(t, Torch.name, run.name)  # torch's time / jaxtp's
    tokens = cfg.train.batch_size * cfg.model.seq_len
    return {"jaxtp_tokens_per_s": tokens / float(np.median(t[run.name])),
            "torch_tokens_per_s": tokens / float(np.median(t[Torch.name])),
            "value": ratio, "ratio_min": lo, "ratio_max": hi}


def one_device(cfg: Config, warmup: int, rounds: int, timeout: float = 900) -> dict:
    """`timed` for `cfg` in a process of its own with one CPU device (the
    suite's process has 8 fake devices, which share one thread pool: a tp=1
    step there ran 1.2x slower, jaxlib 0.10.2): the same dict, or
    {"reason": why not}."""
    argv = [sys.executable, "-m", "jaxtp.bench.torch_peer", "--warmup", str(warmup),
            "--rounds", str(rounds), "--config", json.dumps(cfg.to_dict())]
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    try:
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"reason": f"the one-device process took over {timeout:.0f} s"}
    lines = r.stdout.strip().splitlines()
    if r.returncode or not lines:
        said = r.stderr.strip().splitlines() or [f"exit {r.returncode}, no output"]
        return {"reason": said[-1]}
    return json.loads(lines[-1])


def main(argv=None) -> int:
    """`python -m jaxtp.bench.torch_peer`: `timed` of a config at tp=1 on one
    CPU device, as one JSON line (what `one_device` runs)."""
    ap = argparse.ArgumentParser(prog="python -m jaxtp.bench.torch_peer")
    ap.add_argument("--config", required=True, help="a config as JSON (Config.to_dict)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")  # before the backend starts
    jax.config.update("jax_num_cpu_devices", 1)
    cfg = Config.from_dict(json.loads(args.config))
    print(json.dumps(timed(build("jaxtp", cfg), cfg, args.warmup, args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
