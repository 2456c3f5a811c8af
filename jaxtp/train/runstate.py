"""`RunState`: what a checkpoint records beside the arrays, as one value.

A run's identity (the model's shapes, the mesh it was saved at, the seed,
batch size and data that fix the data order, the lr schedule) and its
position (the step, and the loop's device-side counters read back at the
save). Saving writes exactly its fields as the checkpoint's JSON meta;
resuming reads them back and checks that they continue this run.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..config import Config
from ..axes import mesh_words
from .checkpoint import CheckpointError, Checkpointer
from .data import same_data
from .state import TrainState, abstract_train_state

# the lr schedule's fields, recorded (a resume's changes to them are checked
# against the run directory's config: jaxtp.train.rundir)
SCHEDULE_KEYS = ("steps", "lr", "warmup_steps", "min_lr_ratio")
# the fields that fix the data order besides the data: a resume refuses a change
ORDER_KEYS = ("seed", "batch_size")


@dataclasses.dataclass(frozen=True)
class RunState:
    model: dict  # dataclasses.asdict(ModelConfig): the checkpoint's shapes
    dp: int
    tp: int
    seed: int
    batch_size: int
    data: dict  # the tokens' source, count and content hash (`jaxtp.train.data.data_identity`)
    schedule: dict
    data_position: int = 0  # the step saved: batches 1..data_position were consumed
    loop: dict | None = None  # LoopState.to_json() at that step
    row: dict | None = None  # the metrics row logged at that step, if one was
    # every mesh axis's degree at the save (pp, dp, ep, tp, cp); older
    # checkpoints have only dp and tp
    degrees: dict | None = None

    @classmethod
    def of(cls, cfg: Config, data: dict) -> "RunState":
        """A new run of `cfg` on the data `data` (at step 0)."""
        t = cfg.train
        return cls(model=dataclasses.asdict(cfg.model), dp=cfg.parallel.dp, tp=cfg.parallel.tp,
                   seed=t.seed, batch_size=t.batch_size, data=data,
                   schedule={k: getattr(t, k) for k in SCHEDULE_KEYS},
                   degrees=cfg.parallel.degrees)

    @property
    def step(self) -> int:
        return self.data_position

    def save(self, ckpt: Checkpointer, step: int, loop: dict, params, opt_state,
             row: dict | None = None) -> "RunState":
        """Checkpoint `params`, `opt_state` and this run at `step` (with the
        metrics row of `step`, so a log cut there can be made whole); the saved state."""
        saved = dataclasses.replace(self, data_position=step, loop=loop | {"step": step},
                                    row=row)
        ckpt.save(step, params, opt_state, dataclasses.asdict(saved))
        return saved

    def resume(self, ckpt: Checkpointer, cfg: Config, mesh,
               log: Callable[[str], None]) -> tuple[TrainState, "RunState"]:
        """The train state and run of the latest usable checkpoint (at any dp/tp),
        after checking that it continues this run."""
        target = abstract_train_state(cfg, mesh)
        step, params, opt_state, meta = ckpt.restore(target.params, target.opt_state,
                                                     model=self.model)
        if "loop" not in meta:
            raise CheckpointError(f"{ckpt.directory} step {step} was written by an older jaxtp "
                                  "(no loop state in its meta); resume it with that version")
        saved = RunState(**{f.name: meta.get(f.name) for f in dataclasses.fields(RunState)})
        for key in ORDER_KEYS:
            if getattr(saved, key) != getattr(self, key):
                raise ValueError(f"--resume: the checkpoint was trained with {key}="
                                 f"{getattr(saved, key)!r}, this run has {getattr(self, key)!r}; "
                                 "the data order depends on it")
        if not same_data(saved.data, self.data):
            raise ValueError(f"--resume: the data differs from the checkpoint's: it was trained "
                             f"on {_said(saved.data)}, this run reads {_said(self.data)}; pass "
                             "the run's data (same content; any path) with --data")
        if isinstance(saved.data, dict) and saved.data["source"] != self.data["source"]:
            log(f"note: the run's data ({saved.data['source']}) is now read from "
                f"{self.data['source']}: the same content")
        log(f"resumed from {ckpt.directory} step {step} (saved at "
            f"{mesh_words(saved.degrees or {'dp': saved.dp, 'tp': saved.tp})}; now "
            f"{mesh_words(self.degrees)})")
        state = dataclasses.replace(target, params=params, opt_state=opt_state)
        return state, dataclasses.replace(self, data_position=step, loop=saved.loop,
                                          row=saved.row)


def _said(data: dict | str) -> str:
    if isinstance(data, str):
        return data
    return f"{data['source']} ({data['tokens']:,} {data['dtype']} tokens, sha256 " \
           f"{data['sha256'][:12]}...)"
