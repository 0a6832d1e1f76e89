"""A training run that records what issue 43's multi-rank checks compare: each step's loss and `grad_norm` (from
metrics.jsonl) and the expert bias b after every step (in the process; None where the bias is off)."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIAS_ON = ("model.moe.expert_bias=true", "model.moe.bias_update_rate=0.01")


def train_recording(overrides, run_dir) -> dict:
    from nagmoe.config import load_config
    from nagmoe.model.router_health import expert_biases
    from nagmoe.rundir.metrics import read_metrics
    from nagmoe.train.trainer import Trainer

    class RecordingBias(Trainer):
        def train_step(self):
            rec = super().train_step()
            b = expert_biases(self.model)
            self.biases.append(None if b is None else b.tolist())
            return rec

    trainer = RecordingBias(load_config(os.path.join(REPO, "configs/tiny.yaml"), overrides), run_dir, quiet=True)
    trainer.biases = []
    trainer.run()
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    return {"losses": [(r["step"], r["loss"]) for r in records],
            "grad_norms": [(r["step"], r["grad_norm"]) for r in records], "biases": trainer.biases}
