"""What a run logs per row: speed, model FLOP/s and MFU, and where it goes
(`metrics.jsonl`, optionally TensorBoard)."""

from __future__ import annotations

import json
import math
from pathlib import Path

# Peak dense bf16 FLOP/s per chip, by a substring of `device.device_kind`
# (vendor datasheets: NVIDIA A100 312 TFLOP/s, H100/H200 SXM 989; Google Cloud
# TPU v4 275, v5e 197, v5p 459). fp32 runs measure MFU against the bf16 peak too.
# First match wins: "TPU v5" (what a v5p VM reports) after the v5e names.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "TPU v5p": 459e12,
              "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5": 459e12, "TPU v4": 275e12}


def peak_flops(device) -> float | None:
    kind = getattr(device, "device_kind", "")
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)


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


class MetricsLog:
    """Appends rows to `metrics.jsonl` (dropping rows after `resumed_at`, which a
    resumed run logs again) and, with `tensorboard`, writes them as scalars."""

    def __init__(self, out: Path, resumed_at: int = 0, tensorboard: bool = False):
        self.path = out / "metrics.jsonl"
        if self.path.exists():
            rows = [r for r in self.path.read_text().splitlines() if r.strip()]
            self.path.write_text("".join(r + "\n" for r in rows
                                         if json.loads(r)["step"] <= resumed_at))
        self.writer = (self.check_tensorboard()(str(out / "tensorboard")) if tensorboard
                       else None)
        self.file = open(self.path, "a")

    @staticmethod
    def check_tensorboard():
        """tensorboardX's SummaryWriter, or an ImportError that says what to install."""
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError("--tensorboard needs the tensorboardX package: "
                              "pip install tensorboardX") from None
        return SummaryWriter

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.writer is not None:
            for k, v in row.items():
                if k != "step" and v is not None:
                    self.writer.add_scalar(k, v, row["step"])

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()
