"""What MoD really skipped, for metrics.jsonl and summary.json (issue 23, "honest reporting").

Per step (from the calibrator's `last_step`, already summed over data-parallel ranks): per sublayer the skipped
token share and its share of the skippable work, the work-weighted skip (the quantity `model.mod.skip_rate`
targets in global mode) and the plain token mean. Over the run: the same averaged over the *skipping* steps
only (steps before skipping starts would dilute them), the whole-run executed fraction beside them, and the
training FLOPs as executed by the step's MoD implementation (`model.mod.impl` as resolved on the model's device:
gather pads attention's ragged executed queries to the longest row, B x max rows; static computes every row but the
MoE's expert GEMMs; nagmoe/config/flops.py) next to the FLOPs charged to the budget (`progress.flops`, the same for
both), and the full-depth FLOPs of the same tokens: what MoD saved as executed. Each step is priced by the
implementation it ran (`model.mod.impl` may change on resume); `mod_impl_steps` counts them.

The totals are saved with the trainer's progress (`Progress.mod_account`); a run dir from before this
accounting resumes with totals from its resume step (`since_step`).
"""
from __future__ import annotations

from typing import Optional

from nagmoe.config.flops import executed_flops_per_token, flops_per_token


class ModAccount:
    def __init__(self, model_cfg, seq_len: int, calibrator, state: Optional[dict] = None, step: int = 0,
                 convention: str = "matmul"):
        self.model_cfg, self.seq_len, self.cal, self.convention = model_cfg, seq_len, calibrator, convention
        self.full_per_token = flops_per_token(model_cfg, seq_len, None, convention)
        n = calibrator.n_sublayers
        self.state = dict(state) if state else {"since_step": step, "skipping_steps": 0, "skipping_tokens": 0.0,
                                                "executed_skipping": [0.0] * n, "flops_executed": 0.0,
                                                "flops_full_depth": 0.0, "impl_steps": {}}
        # totals saved before issue 69 lack these: no full-depth total (its saving would mix spans), steps from here
        self.state.setdefault("flops_full_depth", None)
        self.state["impl_steps"] = dict(self.state.get("impl_steps") or {})

    def impl(self) -> str:
        """The MoD implementation this step runs: model.mod.impl resolved where the calibrator lives."""
        return self.cal.resolved_impl(self.cal.threshold.device)

    def record(self, batch_tokens: int) -> dict:
        """Fold in the step the calibrator just updated; returns the step's metrics fields."""
        last = self.cal.last_step
        executed, padded = last["executed"], last["padded"]
        s = self.state
        impl = self.impl()
        s["flops_executed"] += executed_flops_per_token(self.model_cfg, self.seq_len, executed, padded,
                                                        self.convention, impl) * batch_tokens
        if s["flops_full_depth"] is not None:
            s["flops_full_depth"] += self.full_per_token * batch_tokens
        s["impl_steps"] = {**s["impl_steps"], impl: s["impl_steps"].get(impl, 0) + 1}  # new dicts, as the lists
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
               "flops_executed": self.state["flops_executed"], **self.saved()}
        fr = self.skipping_fractions()
        out.update({"skip_rate": 0.0, "skip_rate_tokens": 0.0, "skip_per_sublayer": None,
                    "skip_work_share_per_sublayer": None} if fr is None else
                   {"skip_rate": self.cal.skip_rate_of(fr), "skip_rate_tokens": self.cal.token_skip_rate(fr),
                    "skip_per_sublayer": [1.0 - f for f in fr],
                    "skip_work_share_per_sublayer": self.cal.work_shares(fr)})
        return out

    def saved(self) -> dict:
        """Which implementation ran (`mod_impl`: one name, or several joined by '+' in step order of first use when
        a resume changed it) and the share of the full-depth FLOPs that MoD saved as executed."""
        s = self.state
        full = s.get("flops_full_depth")
        return {"mod_impl": "+".join(s["impl_steps"]) or None, "mod_impl_steps": dict(s["impl_steps"]),
                "flops_full_depth": full,
                "executed_saving": 1.0 - s["flops_executed"] / full if full else None}
