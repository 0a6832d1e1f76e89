"""The trainer's two alarms between steps (nagmoe/train/guards.py holds their arithmetic and lines): the
non-finite guard's verdict, and the gate-collapse check on a step's record. A mixin of Trainer: it reads the
trainer's config, model, mesh, last batch and progress."""
from __future__ import annotations

import sys

from nagmoe.base.errors import warn
from nagmoe.train.guards import (EXIT_NONFINITE, TrainingHalted, collapsed_fraction, gate_collapse_message,
                                 locate_nonfinite, nonfinite_message, realised_gains)


class TrainerGuards:
    def _nonfinite(self, loss: float, grad_norm, halt: bool = False) -> None:
        """The non-finite guard fired: name where (a re-run of the step's last batch), then halt (TrainingHalted,
        exit 3) or count the skip (`train.nonfinite=skip`). DeepSpeed (`halt`) always halts: its step is not
        ours to skip. Every rank reaches this together (the guard's agreement: step_decisions.poison_term)."""
        x, y = self._last_batch
        where = locate_nonfinite(self.model, x, y, self.autocast,
                                 allow_backward=not self.mesh.distributed and self.engine is None)
        mode = "halt" if halt else self.cfg.train.nonfinite
        message = nonfinite_message(self.progress.step, loss, grad_norm, where, mode)
        if mode == "halt":
            if self.rank == 0:
                print(f"nagmoe train: error: {message}", file=sys.stderr, flush=True)
            raise TrainingHalted(message, EXIT_NONFINITE)
        self.progress.nonfinite_skipped += 1
        if self.rank == 0:
            warn(message)

    def _gate_check(self, rec: dict) -> bool:
        """The gate-collapse alarm on the metrics record `rec` of this step: adds `gate_collapsed_fraction` (and
        `gate_collapse_alarm`) on check steps (`train.gate_collapse_every`, once the injection warm-up is over);
        True when the run must stop (`train.gate_collapse_stop`)."""
        t, m = self.cfg.train, self.cfg.model
        if (m.residual != "nag" or not t.gate_collapse_every or rec["step"] % t.gate_collapse_every
                or rec["injection_warmup"] < 1.0):
            return False
        gains = realised_gains(self.model, self._last_batch[0], self.autocast)
        if self.mesh.distributed:  # the batch differs per rank: decide on the mean, identically everywhere
            gains = list(self.mesh.mean(gains))
        fraction = collapsed_fraction(gains)
        rec["gate_collapsed_fraction"] = fraction
        if fraction <= t.gate_collapse_fraction:
            return False
        rec["gate_collapse_alarm"] = True
        if self.rank == 0:
            warn(gate_collapse_message(rec["step"], gains, fraction, t.gate_collapse_fraction,
                                       t.gate_collapse_stop))
        return t.gate_collapse_stop
