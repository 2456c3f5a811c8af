"""What a run logs per row: speed, model FLOP/s and MFU (against the one
hardware table, `jaxtp.hardware`), and where it goes (`metrics.jsonl`,
optionally TensorBoard)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .rundir import write_atomic



def finite(x) -> float | None:
    """A float for metrics.jsonl; NaN and inf (not JSON) become null."""
    x = float(x)
    return x if math.isfinite(x) else None


def speed(step_time_s: float | None, tokens_per_step: int, flops_per_token: float,
          devices: int, peak: float | None) -> dict:
    """step_time_s, tokens_per_sec, model_tflops_per_device and mfu (model
    flops per second per device over the device's peak); all null untimed."""
    if not step_time_s:
        return dict.fromkeys(("step_time_s", "tokens_per_sec", "model_tflops_per_device",
                              "mfu"))
    tokens_per_sec = tokens_per_step / step_time_s
    flops = tokens_per_sec * flops_per_token / devices
    return {"step_time_s": step_time_s, "tokens_per_sec": tokens_per_sec,
            "model_tflops_per_device": flops / 1e12, "mfu": flops / peak if peak else None}


def skip_line(loop: dict, limit: int) -> str:
    """The log line of a skipped step, from the loop's row totals."""
    return (f"step {loop['skip_step']}: skipped (loss {loop['skip_loss']:.4g}, grad_norm "
            f"{loop['skip_grad_norm']:.4g}): parameters and optimizer state unchanged "
            f"[{loop['row_skipped']} skipped since the last row; {loop['in_a_row']} in a row "
            f"of max {limit}]")


def metrics_row(step: int, metrics: dict, loop: dict, speed_fields: dict) -> dict:
    """A metrics.jsonl row from the step's metrics and the loop's row totals."""
    return {"step": step,
            "loss": loop["row_loss"] / loop["row_applied"] if loop["row_applied"] else None,
            "grad_norm": finite(metrics["grad_norm"]), "lr": float(metrics["lr"]),
            "skipped": loop["row_skipped"], **speed_fields}


def clock(seconds: float) -> str:
    """A duration as h:mm:ss, or m:ss under an hour."""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def progress_line(row: dict, steps: int, dt: float | None, eval_loss: float | None,
                  elapsed: float | None = None, left: int = 0) -> str:
    """The printed line of a metrics row; `elapsed`: seconds since the loop
    started, `left`: steps still to run (the ETA is `left` at `dt` a step,
    evaluations and saves not counted)."""
    when = ("" if elapsed is None else f" | {clock(elapsed)} elapsed"
            + (f", ETA {clock(left * dt)}" if dt and left else ""))
    return (f"step {row['step']:>5}/{steps} | loss "
            + (f"{row['loss']:.4f}" if row["loss"] is not None else "-")
            + " | grad_norm " + (f"{row['grad_norm']:.3f}" if row["grad_norm"] is not None
                                 else "nan")
            + f" | lr {row['lr']:.2e} | "
            + (f"{row['tokens_per_sec']:,.0f} tok/s, {dt * 1e3:.0f} ms/step"
               if dt else "first step")
            + (f", MFU {row['mfu']:.1%}" if row["mfu"] else "")
            + (f" | {row['skipped']} skipped" if row["skipped"] else "")
            + (f" | eval_loss {eval_loss:.4f}" if eval_loss is not None else "") + when)


class MetricsLog:
    """Appends rows to `metrics.jsonl` and, with `tensorboard`, writes them as
    scalars. A resumed run's log is first cut back to what a straight run
    would hold at `resumed_at`: a trailing line that a kill cut short is
    dropped (said once through `log`), and so are the rows after
    `resumed_at`, which the resumed run logs again. `saved_row`, the row of
    `resumed_at` its checkpoint kept, is put back where the log lacks it
    (cut short as the checkpoint was written)."""

    def __init__(self, out: Path, resumed_at: int = 0, tensorboard: bool = False,
                 log=print, saved_row: dict | None = None):
        self.path, self.error = out / "metrics.jsonl", None
        if self.path.exists():
            rows = [r for r in self._rows(log) if r["step"] <= resumed_at]
            if saved_row is not None and saved_row.get("step") == resumed_at and \
                    not any(r["step"] == resumed_at for r in rows):
                rows.append(saved_row)
                log(f"{self.path}: its row of step {resumed_at} is restored from the "
                    "checkpoint of that step")
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in rows))
        self.writer = (self.check_tensorboard()(str(out / "tensorboard")) if tensorboard
                       else None)
        self.file = open(self.path, "a")

    def _rows(self, log) -> list[dict]:
        lines = self.path.read_text().splitlines()
        rows = []
        for i, line in enumerate(lines):
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                if i < len(lines) - 1:
                    raise ValueError(f"{self.path} line {i + 1} is not JSON (only the last "
                                     "line can be cut short by a kill): repair or remove "
                                     "that line, then --resume again") from None
                log(f"{self.path}: dropped its last line, cut short mid-write: "
                    f"{line[:60]!r}")
                row = None
            if row is not None:
                if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                    raise ValueError(f"{self.path} line {i + 1} is not a metrics row")
                rows.append(row)
        return rows

    @staticmethod
    def check_tensorboard():
        """tensorboardX's SummaryWriter, or an ImportError that says what to install."""
        try:
            from tensorboardX import SummaryWriter  # optional dependency ([tensorboard])
        except ImportError:
            raise ImportError("--tensorboard needs the tensorboardX package: "
                              "pip install -e '.[tensorboard]' (or tensorboardX)") from None
        return SummaryWriter

    def write(self, row: dict) -> None:
        """Append a row; a failed write is kept in `error` (the loop stops on
        it at the next synchronised step) rather than raised in process 0 alone."""
        try:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        except OSError as e:
            self.error = self.error or f"cannot write {self.path} ({e.strerror})"
            return
        if self.writer is not None:
            for k, v in scalars(row):
                self.writer.add_scalar(k, v, row["step"])

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()


def scalars(row: dict):
    """A row's (tag, number) pairs for TensorBoard: a list's entries under
    tag/i, a list of lists' under tag/i/j (a MoE layer's experts)."""
    for k, v in row.items():
        if k == "step" or v is None:
            continue
        if not isinstance(v, list):
            yield k, v
            continue
        for i, x in enumerate(v):
            if isinstance(x, list):
                yield from ((f"{k}/{i}/{j}", y) for j, y in enumerate(x))
            else:
                yield f"{k}/{i}", x


def losses_said(losses: list[float], rows: list[dict]) -> str:
    """The done line's losses: first and last of the applied steps, and the
    skipped ones counted."""
    skipped = sum(r["skipped"] for r in rows)
    said = (f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else
            "no logged step applied (each was skipped)")
    return said + (f" ({skipped} step{'s' * (skipped > 1)} skipped)" if skipped else "")
