"""Checkpoints: orbax save/restore with resharding and corruption checks.

A step is one orbax CheckpointManager step of three items: `arrays` (params
and optimizer state as one flat dict), `meta` (the caller's JSON: model
config, dp, tp, data position, ...) and `manifest` (JSON: each array's shape,
dtype and fingerprint, and a sha256 of both JSON items).

- Flat, path-keyed arrays. The nnx parameter treedef depends on tp (a kv
  projection is "sharded" at one tp, "replicated" at another); paths and
  shapes do not. Arrays are saved as `"params" + keystr(path)` and
  `"opt_state" + keystr(path)`; restore flattens the caller's target the same
  way, reads each array straight into the target leaf's sharding (each device
  reads only its slices) and unflattens into the target's treedef. So a tp=8
  run resumes at tp=4, tp=1 or another dp. The blocks are a list of L
  layers (`['blocks'][i]`) or one stack of them [L, ...] (scanned, and
  always under pp): a step saved in one form is read in that form, checked,
  and restacked or sliced into the other (`layer_forms.layer_plan`), so a pp=2 run
  resumes unpipelined too (its blocks whole on every device for a moment).
- Complete steps. Orbax writes `<step>.orbax-checkpoint-tmp` and renames it
  to `<step>` once every item is committed (on GCS, where rename is not
  atomic, `commit_success.txt` marks the end). A save killed midway is never
  a step; orbax ignores its directory and replaces it if the step is saved.
- Fingerprints. Orbax does not checksum array data: a flipped byte in a
  stored chunk restores as silently wrong numbers (orbax 0.12.8: zstd frames
  without checksum), and tensorstore reads a missing chunk as zeros where
  that is allowed (0.12.8 disallows it: a missing or truncated file raises).
  So each array's fingerprint is stored: two sums mod 2**32 (two seeds) of a
  hash of each element's bit pattern and linear position. Integer addition
  is associative, so it is computed on device, sharded, and is bit-identical
  for any layout: no tolerance, and a changed, zeroed or misplaced element
  (a shard read into the wrong place) is caught but for a 2**-64 chance.
- A step that cannot be read, whose JSON fails its checksum or whose arrays
  fail their fingerprints is corrupt: `restore` warns, naming it, and falls
  back to the previous complete step (the reads of it orbax leaves waiting
  print nothing: `orbax_errors.quiet_abandoned_reads`). It is deleted only when `save`
  writes that step (or an earlier one) again. A different model (a shape-changing
  config key, or an array's name, shape or dtype) is an error, not a
  fallback, as the run's older steps share it.
- Multi-process: every process calls every method; orbax coordinates the
  writes (each process writes its own shards). Nothing here writes a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from ..config import ModelConfig
from ..config_keys import RENAMED
from ..parallel.distributed import any_process
from .fingerprint import fingerprints, nbytes
from .layer_forms import _LAYER, layer_plan
from .options import Notice
from .orbax_errors import brief, quiet_abandoned_reads, quiet_orbax

FORMAT = 1
# Model config keys that change parameter names, shapes or dtypes (a stale
# list is caught by the per-array shape check, with a less helpful message).
# (scan_layers is not one: a stacked step is sliced for a list model, and
# the other way round: `layer_forms`)
SHAPE_KEYS = ("style", "vocab_size", "vocab_multiple", "n_layers", "d_model", "n_heads",
              "n_kv_heads", "d_ff", "seq_len", "param_dtype", "tie_embeddings", "use_bias")
_MISSING = "<absent>"


def _agree(why: str | None) -> None:
    """Raise SaveFailed in every process if any has a reason: one process
    stopping alone would leave the others waiting in a collective."""
    if any_process(why is not None):
        raise SaveFailed(why or "a checkpoint save failed in another process: see its log")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or restored as asked (the message says why and what to do)."""


class SaveFailed(CheckpointError):
    """A save failed or would not fit, or another file of the run could not be
    written (the file system's fault, not the run's): the checkpoints saved
    before it are intact."""


def _flatten(prefix: str, tree) -> tuple[dict[str, Any], Any]:
    """({"prefix" + keystr(path): leaf}, treedef)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {prefix + jax.tree_util.keystr(path): leaf for path, leaf in leaves}
    if len(flat) != len(leaves):
        raise CheckpointError(f"two leaves of {prefix} have the same path name; cannot save")
    return flat, treedef


class Checkpointer:
    """Saves and restores (params, opt_state, meta) steps in `directory` (see module doc)."""

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True,
                 log: Callable[[str], None] = print, layer_order=None):
        """`layer_order`: the model's `Layout.layer_order` where its stacked
        layers are not in model order (a circular pipeline's): a step holds
        them in model order, so that any layout reads it."""
        if keep < 1:
            raise CheckpointError(f"keep={keep}: must keep at least 1 checkpoint")
        text = os.fspath(directory)
        self.directory = epath.Path(text if "://" in text else os.path.abspath(text))
        self.log = log
        self._corrupt: set[int] = set()  # steps restore() found unusable
        self._saving: int | None = None  # the step of the last save started
        self._order = None if layer_order is None else np.asarray(layer_order)
        quiet_abandoned_reads()
        quiet_orbax()  # after ours: it looks at the hook on top only
        options = ocp.CheckpointManagerOptions(max_to_keep=keep,
                                               enable_async_checkpointing=async_save)
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        """Complete steps, ascending (not one still being written)."""
        return sorted(s for s in self._mngr.all_steps()
                      if ocp.utils.is_checkpoint_finalized(self.directory / str(s)))

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        """Start saving; returns once the arrays are copied off the devices.
        Raises SaveFailed if the previous save failed or this one cannot fit
        (in every process, if in any)."""
        self.finish()
        for s in sorted(self._corrupt & set(self.steps())):
            if s >= step:  # newer than what we resumed from, and unusable
                self.log(Notice(f"WARNING: deleting corrupt checkpoint step {s} in "
                                f"{self.directory} before saving step {step}"))
                self._mngr.delete(s)
                self._corrupt.discard(s)
        later = [s for s in self.steps() if s >= step]
        if later:
            raise CheckpointError(
                f"cannot save step {step} in {self.directory}: it already holds step(s) "
                f"{later}; resume from the latest step, or move those step directories aside")
        try:
            meta = json.loads(json.dumps(meta))  # as it will read back (tuples -> lists, ...)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint meta must be JSON-serialisable: {e}") from None
        pflat, _ = _flatten("params", params)
        oflat, _ = _flatten("opt_state", opt_state)
        arrays = self._reorder({**pflat, **oflat}, None if self._order is None
                               else np.argsort(self._order))
        self.check_space(nbytes(arrays.values()), f"save checkpoint step {step}")
        if (self.directory / f"{step}.orbax-checkpoint-tmp").exists():
            self.log(Notice(f"note: step {step} in {self.directory} was half-written by a save "
                            "that was cut short; orbax replaces it"))
        manifest = {"format": FORMAT, "arrays": {
            name: {"shape": list(x.shape), "dtype": jnp.dtype(x.dtype).name, "fingerprint": fp}
            for (name, x), fp in zip(arrays.items(), fingerprints(list(arrays.values())))}}
        manifest["checksum"] = _checksum(manifest, meta)
        saved = self._mngr.save(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta),
            manifest=ocp.args.JsonSave(manifest)), force=True)
        if not saved:
            raise CheckpointError(f"orbax declined to save step {step} in {self.directory}")
        self._saving = step

    def check_space(self, size: int, what: str) -> None:
        """Refuse (SaveFailed: "cannot {what}") a save of `size` bytes that the
        file system has no room for, before writing anything (local
        directories; every process checks, as each writes its own shards)."""
        why = None
        if "://" not in os.fspath(self.directory):
            where = next(p for p in (self.directory, *self.directory.parents) if p.exists())
            free = shutil.disk_usage(os.fspath(where)).free
            if free < size:
                why = (f"cannot {what} in {self.directory}: a checkpoint takes "
                       f"{size / 2**20:,.1f} MiB and the file system has "
                       f"{free / 2**20:,.1f} MiB free{self._latest_said()}")
        _agree(why)

    def _latest_said(self) -> str:
        latest = self.latest_step()
        return ("; no checkpoint of this run is saved yet" if latest is None else
                f"; the latest complete checkpoint is step {latest}")

    def failed_save(self) -> str | None:
        """Without waiting: why the last save failed in the background, once it
        has (None while it runs, after it succeeded, or when none was started)."""
        if self._saving is None or self._mngr.is_saving_in_progress():
            return None
        try:
            self.wait()
        except SaveFailed as e:
            return str(e)
        return None

    def finish(self) -> None:
        """`wait`, agreed: a failed save raises SaveFailed in every process."""
        why = None
        try:
            self.wait()
        except SaveFailed as e:
            why = str(e)
        _agree(why)

    def wait(self) -> None:
        """Block until pending saves are committed (and old steps removed)."""
        step, self._saving = self._saving, None
        try:
            self._mngr.wait_until_finished()
        except Exception as e:
            raise SaveFailed(f"saving checkpoint step {step} in {self.directory} failed: "
                             f"{brief(e)}{self._latest_said()}") from e

    def restore(self, params_target, opt_target, model: dict, step: int | None = None):
        """(step, params, opt_state, meta) from `step`, or the latest usable step.

        Targets: pytrees of ShapeDtypeStructs with shardings, or of jax.Arrays;
        the result has their structure and shardings. Raises CheckpointError
        if the model differs or no step is usable; a corrupt latest step is
        skipped with a warning (an explicitly asked `step` is not).
        """
        pflat, pdef = _flatten("params", params_target)
        oflat, odef = _flatten("opt_state", opt_target)
        target = {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                  for name, x in {**pflat, **oflat}.items()}
        available = self.steps()
        if step is not None and step not in available:
            raise CheckpointError(f"no complete checkpoint step {step} in {self.directory}; "
                                  f"complete steps: {available}")
        candidates = [step] if step is not None else available[::-1]
        if not candidates:
            raise CheckpointError(f"no complete checkpoint in {self.directory} to restore; "
                                  "check the directory, or start a fresh run")
        failures = []
        for i, s in enumerate(candidates):
            reason, arrays, meta = self._try_restore(s, target, model)
            if reason is None:
                return (s, jax.tree_util.tree_unflatten(pdef, [arrays[n] for n in pflat]),
                        jax.tree_util.tree_unflatten(odef, [arrays[n] for n in oflat]), meta)
            self._corrupt.add(s)
            failures.append(f"step {s}: {reason}")
            then = (f"falling back to step {candidates[i + 1]}" if i + 1 < len(candidates)
                    else "no earlier step to fall back to")
            self.log(Notice(f"WARNING: checkpoint step {s} in {self.directory} is unusable "
                            f"({reason}); {then}"))
        raise CheckpointError(
            f"no usable checkpoint in {self.directory}: {'; '.join(failures)}. Move the "
            "corrupt step directories aside (or restore another step), or start afresh")

    def _try_restore(self, step: int, target: dict, model: dict):
        """(None, {name: array}, meta), or (why the step is corrupt, None, None)."""
        try:
            items = self._mngr.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore(), manifest=ocp.args.JsonRestore()))
            meta, manifest = items.meta, items.manifest
            if manifest.get("format") != FORMAT:
                return f"unknown manifest format {manifest.get('format')!r}", None, None
            if manifest.get("checksum") != _checksum(manifest, meta):
                return "its meta/manifest JSON does not match its checksum", None, None
            saved = manifest["arrays"]
        except Exception as e:
            return f"cannot read its meta/manifest: {brief(e)}", None, None
        self._check_model(step, meta.get("model"), model)
        read, convert = layer_plan(saved, target)
        self._check_arrays(step, saved, read)
        try:
            arrays = self._mngr.restore(step, args=ocp.args.Composite(
                arrays=ocp.args.StandardRestore(read))).arrays
        except Exception as e:
            return f"cannot read its arrays: {brief(e)}", None, None
        names = list(read)
        for name, fp in zip(names, fingerprints([arrays[n] for n in names])):
            if fp != saved[name]["fingerprint"]:
                return (f"data of {name} differs from what was saved (fingerprint "
                        f"{fp:016x}, saved {saved[name]['fingerprint']:016x})"), None, None
        return None, self._reorder(convert(arrays), self._order), meta

    @staticmethod
    def _reorder(arrays: dict, order) -> dict:
        """The stacked layers' arrays (params and optimizer state) with stack
        position j holding what position order[j] held (`reorder_layers`)."""
        if order is None or (order == np.arange(order.size)).all():
            return arrays
        stacked = lambda n: "['blocks']" in n and not _LAYER.search(n)
        return {n: jax.device_put(x[order], x.sharding) if stacked(n) else x
                for n, x in arrays.items()}

    def _check_model(self, step: int, saved: dict | None, model: dict) -> None:
        if saved is None:
            return  # no config to compare; the per-array check still applies
        # (a key renamed since, or added since at its default then)
        saved = {RENAMED["model"].get(k, k): v for k, v in saved.items()}
        saved = {f.name: f.default for f in dataclasses.fields(ModelConfig)} | saved
        changed = [k for k in sorted(set(saved) | set(model))
                   if saved.get(k, _MISSING) != model.get(k, _MISSING)]
        said = {k: f"{k}={saved.get(k, _MISSING)!r} in the checkpoint vs "
                   f"{model.get(k, _MISSING)!r} now" for k in changed}
        shape = [said[k] for k in changed if k in SHAPE_KEYS]
        if shape:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} is of a different model: "
                f"{', '.join(shape)}. Use the checkpoint's model config (a different tp or dp "
                "is fine), or a new checkpoint directory")
        if changed:
            self.log(Notice(f"note: restoring step {step} with changed model settings that keep "
                            f"all shapes: {', '.join(said.values())}"))

    def _check_arrays(self, step: int, saved: dict, target: dict) -> None:
        for name in sorted(set(saved) | set(target)):
            if name not in saved:
                problem = f"the model has {name}, the checkpoint does not"
            elif name not in target:
                problem = f"the checkpoint has {name}, the model does not"
            else:
                want = (tuple(target[name].shape), jnp.dtype(target[name].dtype).name)
                got = (tuple(saved[name]["shape"]), saved[name]["dtype"])
                if want == got:
                    continue
                problem = f"{name} is {got[1]}{list(got[0])} there, {want[1]}{list(want[0])} here"
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} does not fit this model/optimizer: "
                f"{problem}. Use the config the checkpoint was saved with, or a new directory")

    def close(self) -> None:
        """Wait for pending saves and release orbax's threads (a failed save is
        reported by `wait`, `failed_save` or the save after it, not here)."""
        try:
            self._mngr.close()
        except Exception:
            pass


def _checksum(manifest: dict, meta: dict) -> str:
    """sha256 of the JSON items, so a damaged one is corrupt, not a different model."""
    body = {"manifest": {k: v for k, v in manifest.items() if k != "checksum"}, "meta": meta}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
