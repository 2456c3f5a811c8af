"""Hugging Face Llama, Mixtral and Qwen3-MoE checkpoints <-> jaxtp (no torch needed).

`load_hf(path, tp)` reads a directory written by `transformers`'
`save_pretrained` (`config.json` and `*.safetensors`, read with the
`safetensors` package into numpy) and returns a jaxtp `Transformer` sharded
at that tp (and ep, for a mixture of experts). `save_hf` writes one back in
the Hub's form. What each config key becomes: `jaxtp.hf_config`; each
tensor: `jaxtp.hf_tensors`.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from .config import Config, ModelConfig, ParallelConfig, validate
from .hf_config import NAMES, family, hf_config, model_config_from_hf
from .hf_tensors import hf_to_params, params_to_hf
from .train.state import decide, place_params

__all__ = ["hf_config", "hf_model_config", "hf_to_params", "load_hf", "model_config_from_hf",
           "params_to_hf", "read_hf", "save_hf"]


def _safetensors():
    try:
        from safetensors.numpy import load_file, save_file  # optional dependency ([hf])
    except ImportError:
        raise ImportError("reading Hugging Face checkpoints needs the safetensors package: "
                          "pip install -e '.[hf]' (or pip install safetensors)") from None
    return load_file, save_file


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    load_file, _ = _safetensors()
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own SafetensorError
            raise ValueError(f"{f} cannot be read as safetensors ({e}): a truncated or "
                             "damaged download? fetch it again") from None
    return tensors


def hf_model_config(path: str | Path, **overrides) -> ModelConfig:
    """The jaxtp ModelConfig of a Hugging Face Llama, Mixtral or Qwen3-MoE directory."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} has no config.json (expected a save_pretrained "
                                "directory)")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{file} must hold a JSON object, not {type(hf).__name__}")
    try:
        return model_config_from_hf(hf, **overrides)
    except KeyError as e:
        kind = NAMES.get(hf.get("model_type"), "Llama")
        raise ValueError(f"{file} has no {e.args[0]!r}, which a {kind} config needs") from None
    except ValueError as e:  # a value of the file's: name the file
        raise ValueError(f"{file}: {e}") from None


def read_hf(path: str | Path, **overrides) -> tuple[ModelConfig, dict]:
    """(ModelConfig, nested parameter dict) from a Hugging Face directory.

    `overrides` may change fields that do not touch the tensors' shapes
    (seq_len, dtype, ...); shape-changing ones fail on the first tensor.
    """
    cfg = hf_model_config(path, **overrides)
    return cfg, hf_to_params(_read_tensors(Path(path)), cfg)


def load_hf(path: str | Path, tp: int = 1, impl: str = "gspmd", ep: int = 1, **overrides):
    """A jaxtp Transformer holding the checkpoint at `path`, sharded over a
    (1, tp) mesh, or (1, ep, tp) for a mixture of experts split over ep (kept
    as `model.mesh`). `model(tokens [B, T] int32)` -> logits [B, T,
    vocab_size] (B a multiple of ep). Under jit with impl="shard_map" or
    "explicit", call it inside `with jax.set_mesh(model.mesh):` (both need the
    mesh while tracing; explicit's has Explicit axes).
    """
    model_cfg, values = read_hf(path, **overrides)
    cfg = validate(Config(model=model_cfg, parallel=ParallelConfig(tp=tp, ep=ep, impl=impl)))
    mesh = decide(cfg)[2]
    graphdef, params, _ = place_params(cfg, mesh, values)
    model = nnx.merge(graphdef, params)
    model.mesh = mesh
    return model


def save_hf(model, path: str | Path) -> None:
    """Write a jaxtp Transformer as a Llama, Mixtral or Qwen3-MoE checkpoint
    (`jaxtp.hf_config.family`): config.json + model.safetensors, experts one
    tensor each as the Hub stores them."""
    cfg: ModelConfig = model.cfg
    family(cfg)  # refused before anything is written
    _, save_file = _safetensors()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    values = nnx.to_pure_dict(jax.device_get(nnx.state(model, nnx.Param)))
    save_file(params_to_hf(values, cfg), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
