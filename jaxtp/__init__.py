"""jaxtp: Megatron-style tensor parallelism in JAX/Flax NNX, with proof from HLO.

    config.py   frozen dataclasses, presets, overrides, validation
    parallel/   the mesh, Layout and Schedule; f, g and regions per impl; multi-process start-up
    model/      layers, attention and its kernels, MLP, vocab-parallel embedding, Transformer
    train/      optimizer, state, jitted steps, the loop, checkpoints, data, metrics, run record
    analysis/   the communication budget, --compare-hlo, the planner, compile-only targets
    hlo.py      collectives read from compiled HLO text
    hardware.py the one hardware table, model FLOPs per token
    hf.py       Hugging Face Llama, Mixtral, Qwen3-MoE checkpoints in and out
                (hf_config.py: config.json keys; hf_tensors.py: tensor names)
    bench/      the benchmark suite (python -m jaxtp.bench)

Importing jaxtp (or jaxtp.config) loads nothing else; the names below load
their module on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Config": "config", "ConfigError": "config", "ModelConfig": "config",
    "ParallelConfig": "config", "TrainConfig": "config", "load_config": "config",
    "Layout": "parallel", "Schedule": "parallel", "make_mesh": "parallel",
    "constrain": "parallel", "spec": "parallel",
    "Transformer": "model", "Block": "model", "stack_layers": "model", "reorder_layers": "model",
    "unstack_layers": "model", "init_train_state": "train.state",
    "abstract_train_state": "train.state", "make_optimizer": "train.optim",
    "make_train_step": "train.step", "compile_train_step": "train.step",
    "make_eval_step": "train.step", "loss_fn": "train.step", "grads_of": "train.step",
    "step_controls": "train.step", "compiled_step": "train.step",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'jaxtp' has no attribute {name!r}")
