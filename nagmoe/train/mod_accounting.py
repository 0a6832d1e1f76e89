"""What MoD really skipped, for metrics.jsonl and summary.json (issue 23, "honest reporting").

Per step (from the calibrator's `last_step`, already summed over data-parallel ranks): per sublayer the skipped
token share and its share of the skippable work, the work-weighted skip (the quantity `model.mod.skip_rate`
targets in global mode) and the plain token mean. Over the run: the same averaged over the *skipping* steps
only (steps before skipping starts would dilute them), the whole-run executed fraction beside them, and the
training FLOPs as executed (attention's ragged executed queries padded to the longest row: B x max rows)
next to the FLOPs charged to the budget (`progress.flops`).

The totals are saved with the trainer's progress (`Progress.mod_account`); a run dir from before this
accounting resumes with totals from its resume step (`since_step`).
"""
from __future__ import annotations

from typing import Optional

from nagmoe.config.flops import executed_flops_per_token


class ModAccount:
    def __init__(self, model_cfg, seq_len: int, calibrator, state: Optional[dict] = None, step: int = 0,
                 convention: str = "matmul"):
        self.model_cfg, self.seq_len, self.cal, self.convention = model_cfg, seq_len, calibrator, convention
        n = calibrator.n_sublayers
        self.state = dict(state) if state else {"since_step": step, "skipping_steps": 0, "skipping_tokens": 0.0,
                                                "executed_skipping": [0.0] * n, "flops_executed": 0.0}

    def record(self, batch_tokens: int) -> dict:
        """Fold in the step the calibrator just updated; returns the step's metrics fields."""
        last = self.cal.last_step
        executed, padded = last["executed"], last["padded"]
        s = self.state
        s["flops_executed"] += executed_flops_per_token(self.model_cfg, self.seq_len, executed, padded,
                                                        self.convention) * batch_tokens
        if last["skipping"]:
            s["skipping_steps"] += 1
            s["skipping_tokens"] += last["tokens"]
            s["executed_skipping"] = [a + f * last["tokens"] for a, f in zip(s["executed_skipping"], executed)]
        return {"skip_rate": self.cal.skip_rate_of(executed), "skip_rate_tokens": self.cal.token_skip_rate(executed),
                "skip_per_sublayer": [1.0 - f for f in executed],
                "skip_work_share_per_sublayer": self.cal.work_shares(executed),
                "executed_fractions": executed, "mod_skipping": last["skipping"],
                "flops_executed": s["flops_executed"]}

    def skipping_fractions(self) -> Optional[list]:
        """Executed fraction per sublayer averaged over the skipping steps (None before any)."""
        s = self.state
        if not s["skipping_tokens"]:
            return None
        return [a / s["skipping_tokens"] for a in s["executed_skipping"]]

    def summary(self) -> dict:
        run = self.cal.run_executed_fractions()
        out = {"threshold_mode": self.cal.mode, "target_skip_rate": self.cal.skip_rate,
               "executed_fractions": run, "run_skip_rate": self.cal.skip_rate_of(run),
               "run_skip_rate_tokens": self.cal.token_skip_rate(run),
               "skipping_steps": self.state["skipping_steps"], "mod_account_since_step": self.state["since_step"],
               "flops_executed": self.state["flops_executed"]}
        fr = self.skipping_fractions()
        out.update({"skip_rate": 0.0, "skip_rate_tokens": 0.0, "skip_per_sublayer": None,
                    "skip_work_share_per_sublayer": None} if fr is None else
                   {"skip_rate": self.cal.skip_rate_of(fr), "skip_rate_tokens": self.cal.token_skip_rate(fr),
                    "skip_per_sublayer": [1.0 - f for f in fr],
                    "skip_work_share_per_sublayer": self.cal.work_shares(fr)})
        return out
