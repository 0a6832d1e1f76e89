"""The training configs of tools/gpu_check/gpu_check.sh at its two sizes (GPU, and --cpu's tiny width), shared by
the training sections (tools/gpu_check/gpu_check_train.py) and the committed memory estimates
(tools/gpu_check/gpu_check_estimates.py)."""
from __future__ import annotations

import os

from gpu_check_common import REPO

PAPER = {"baseline": "baseline-r40", "nag": "nag-r40", "nag_mod20": "nag-mod20-r40"}
SIZES = {
    "gpu": dict(vocab=32768, seq=2048, model=[], batch_tokens=65536, steps=8, timed_from=4,
                data_tokens=1_500_000, eval_tokens=32768, matmul_n=8192, resume_steps=4, tolerance=2e-3),
    "cpu": dict(vocab=512, seq=64, batch_tokens=512, micro_batch_tokens=256, steps=3, timed_from=2,
                data_tokens=1 << 16, eval_tokens=512,
                model=["model.d_model=64", "model.n_layers=2", "model.moe.expert_hidden=64",
                       "model.attention.n_heads=4"], matmul_n=512, resume_steps=4, tolerance=1e-5),
}
# GPU: the paper's micro-batch (32768 tokens: 2 micro-steps per step); CPU: the same 2 micro-steps
# injection warm-up: 2 steps on the GPU, 1 on CPU; MoD skips from then on (model.mod.start_tokens=0)
WARMUP_STEPS = {"gpu": 2, "cpu": 1}


def overrides(mode: str, data_dir: str) -> list[str]:
    """The paper config at this check's size: script-made data, EP=1, no eval or checkpoint on the way, MoD from
    the end of a short injection warm-up, and a 2-step LR warm-up so the loss falls within the few steps."""
    s = SIZES[mode]
    return [*s["model"], f"model.vocab_size={s['vocab']}", f"model.max_seq_len={s['seq']}", f"data.seq_len={s['seq']}",
            f"data.data_dir={data_dir}", "data.verify_shards=false", "parallel.ep=1",
            f"train.batch_tokens={s['batch_tokens']}", "model.mod.start_tokens=0",
            *([f"train.micro_batch_tokens={s['micro_batch_tokens']}"] if "micro_batch_tokens" in s else []),
            f"model.nag.warmup_tokens={WARMUP_STEPS[mode] * s['batch_tokens']}", "train.warmup_steps=2",
            "log.wandb=off", "log.every=1", "train.eval_every=0", "train.checkpoint_every=0",
            f"train.eval_tokens={s['eval_tokens']}"]  # log.every=1: each step's loss (the paper configs log every 10)


def load(name: str, extra: list[str]):
    from nagmoe.config import load_config

    return load_config(os.path.join(REPO, "configs", "paper", f"{name}.yaml"), extra)


def paper_config(key: str, mode: str, data: str, extra=()):
    """configs/paper/<PAPER[key]>.yaml at this check's size (`overrides`), then `extra`."""
    return load(PAPER[key], [*overrides(mode, data), *extra])


def micro_batch_tokens(cfg) -> int:
    """Tokens of one micro-step on one rank: the trainer's rule (nagmoe.train.memory.micro_batch_rows)."""
    from nagmoe.train.memory import micro_batch_rows

    return max(1, micro_batch_rows(cfg, 1)) * cfg.data.seq_len
