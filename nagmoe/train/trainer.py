"""The training loop: global batch with gradient accumulation, FLOP-budget stop, LR horizon, eval, checkpoints
with exact resume, metrics.

Step accounting. `step` counts completed optimizer steps. The metrics record of step N, the checkpoint
`step_N` and the LR of the step after it all refer to the state after N steps. Each step consumes
`train.batch_tokens` tokens and `flops_per_token(model, seq_len, executed) * batch_tokens` training FLOPs.
Stop: when `step == train.max_steps`, or when the next step would take the cumulative FLOPs more than half a
step past `train.flop_budget` (so the run ends within half a step of the budget).
"""
from __future__ import annotations

import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from nagmoe.config import Config
from nagmoe.data import shards
from nagmoe.data.loader import TokenLoader, TokenShards, check_data_vocab, iter_eval_batches
from nagmoe.data.bpb import bits_per_byte, bpb_sums, token_bytes
from nagmoe.errors import UserError
from nagmoe.flops import flops_per_token
from nagmoe.model import build_model
from nagmoe.train.checkpoint import latest_valid_checkpoint, load_checkpoint, save_checkpoint
from nagmoe.train.metrics import MetricsWriter, truncate_metrics
from nagmoe.train.optim import build_optimizers
from nagmoe.train.run_dir import prepare_run_dir, write_run_info, write_summary
from nagmoe.train.schedule import injection_warmup, lr_multiplier


@dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    flops: float = 0.0
    wall_s: float = 0.0  # training wall time summed over resumes

    def as_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "flops": self.flops, "wall_s": self.wall_s}


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device: cuda was asked for but no CUDA device is visible")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested)


def resolved_backends(model) -> dict:
    out = {}
    for i, sub in enumerate(model.sublayers()):
        for attr in ("impl", "backend"):
            if hasattr(sub, attr):
                out.setdefault(f"{type(sub).__name__}.{attr}", getattr(sub, attr))
    return out


class Trainer:
    def __init__(self, cfg: Config, run_dir: str, force: bool = False, quiet: bool = False,
                 rank: int = 0, world_size: int = 1):
        self.cfg, self.run_dir, self.quiet = cfg, run_dir, quiet
        self.rank, self.world_size = rank, world_size
        t, m = cfg.train, cfg.model
        self.device = resolve_device(t.device)
        seq = cfg.data.seq_len
        self.global_rows = t.batch_tokens // seq
        if self.global_rows % world_size:
            raise UserError(f"train.batch_tokens: {self.global_rows} rows do not split over {world_size} ranks")
        rank_rows = self.global_rows // world_size
        self.micro_rows = min(rank_rows, (t.micro_batch_tokens // seq) if t.micro_batch_tokens else rank_rows)
        if rank_rows % self.micro_rows:
            raise UserError(f"train.micro_batch_tokens: {self.micro_rows} rows per micro-step do not divide "
                            f"the {rank_rows} rows of this rank")
        self.accum = rank_rows // self.micro_rows

        self._check_data()
        latest = latest_valid_checkpoint(run_dir) if os.path.isdir(run_dir) else None
        prepare_run_dir(run_dir, cfg, resuming=latest is not None, force=force)

        torch.manual_seed(t.seed)
        self.model = build_model(m).to(self.device)
        self.optim = build_optimizers(self.model, t)
        verify = cfg.data.verify_shards
        self.loader = TokenLoader(cfg.data.data_dir, "train", seq, self.micro_rows, t.seed, rank, world_size,
                                  verify=verify)
        self.val_shards = TokenShards(cfg.data.data_dir, "val", verify=verify)
        self.token_bytes = token_bytes(cfg.data.data_dir)
        self.progress = Progress()
        if latest is not None:
            state = load_checkpoint(latest, self.model, self.optim)
            self.progress = Progress(**state["progress"])
            self.loader.load_state_dict(state["loader"])
            truncate_metrics(os.path.join(run_dir, "metrics.jsonl"), self.progress.step)
            self._log(f"resumed from {latest} at step {self.progress.step}")
        self.backends = resolved_backends(self.model)
        write_run_info(run_dir, self.backends, str(self.device),
                       {"resumed_from": latest, "grad_accum": self.accum, "world_size": world_size})
        self._log(f"device {self.device}; backends: {self.backends}; grad accumulation {self.accum}")
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else nullcontext())
        self.wandb = self._init_wandb()

    # ------------------------------------------------------------------------------------------------------
    def _log(self, msg: str) -> None:
        if not self.quiet and self.rank == 0:
            print(f"[nagmoe] {msg}", file=sys.stderr, flush=True)

    def _check_data(self) -> None:
        d = self.cfg.data.data_dir
        index_path = os.path.join(d, shards.INDEX)
        if not os.path.isfile(index_path):
            raise UserError(f"{index_path}: no prepared data; run `nagmoe prepare-data --config ...` first")
        check_data_vocab(d, self.cfg.model.vocab_size)

    def _init_wandb(self):
        mode = self.cfg.log.wandb
        if mode == "off" or self.rank != 0:
            return None
        try:
            import wandb
        except ImportError:
            raise UserError(f"log.wandb={mode} needs wandb: pip install 'nagmoe[wandb]'") from None
        from nagmoe.config import to_dict

        return wandb.init(mode=mode, dir=self.run_dir, project=self.cfg.log.project,
                          name=os.path.basename(os.path.abspath(self.run_dir)), config=to_dict(self.cfg),
                          resume="allow", id=os.path.basename(os.path.abspath(self.run_dir)))

    def executed_fractions(self) -> Optional[list]:
        return None  # full depth; the MoD issue reports realised fractions per sublayer

    def step_flops(self) -> float:
        return flops_per_token(self.cfg.model, self.cfg.data.seq_len, self.executed_fractions()) \
            * self.cfg.train.batch_tokens

    def should_stop(self) -> bool:
        t = self.cfg.train
        if t.max_steps is not None and self.progress.step >= t.max_steps:
            return True
        return t.flop_budget is not None and self.progress.flops + 0.5 * self.step_flops() > t.flop_budget

    # ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        nats, nbytes = 0.0, 0
        for x, y in iter_eval_batches(self.val_shards, self.cfg.data.seq_len, self.micro_rows,
                                      max_tokens=self.cfg.train.eval_tokens, rank=self.rank,
                                      world_size=self.world_size):
            x, y = x.to(self.device), y.to(self.device)
            with self.autocast:
                out = self.model(x, y, reduction="none")
            n, b = bpb_sums(out.loss, y, self.token_bytes)
            nats, nbytes = nats + n, nbytes + b
        self.model.train()
        return bits_per_byte(nats, nbytes)

    def train_step(self) -> dict:
        t, m = self.cfg.train, self.cfg.model
        p = self.progress
        lr_mult = lr_multiplier(p.step, p.flops, t)
        self.optim.set_lr_multiplier(lr_mult)
        warm = injection_warmup(p.tokens, m.nag.warmup_tokens) if m.residual == "nag" else 1.0
        self.model.set_injection_warmup(warm)
        loss_sum = aux_sum = 0.0
        for _ in range(self.accum):
            x, y = next(self.loader)
            x, y = x.to(self.device), y.to(self.device)
            with self.autocast:
                out = self.model(x, y)
            ((out.loss + out.aux_loss) / self.accum).backward()
            loss_sum += out.loss.item()
            aux_sum += out.aux_loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip if t.grad_clip > 0 else
                                                   float("inf"))
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        p.flops += self.step_flops()
        p.step += 1
        p.tokens += t.batch_tokens
        return {"loss": loss_sum / self.accum, "aux_loss": aux_sum / self.accum, "lr": t.lr_matrix * lr_mult,
                "lr_mult": lr_mult, "grad_norm": float(grad_norm), "injection_warmup": warm}

    def _moe_balance(self) -> Optional[float]:
        """max/mean tokens per expert over MoE layers of the last micro-batch (1 = perfectly balanced)."""
        worst = None
        for sub in self.model.sublayers():
            stats = getattr(sub, "last_stats", None)
            if stats and "tokens_per_expert" in stats:
                c = stats["tokens_per_expert"].float()
                ratio = float(c.max() / c.mean().clamp_min(1e-9))
                worst = ratio if worst is None else max(worst, ratio)
        return worst

    def checkpoint(self) -> str:
        state = {"step": self.progress.step, "progress": self.progress.as_dict(),
                 "loader": self.loader.state_dict()}
        return save_checkpoint(self.run_dir, self.progress.step, self.model, self.optim, state,
                               keep=self.cfg.train.keep_checkpoints)

    def run(self) -> dict:
        t = self.cfg.train
        metrics = MetricsWriter(self.run_dir) if self.rank == 0 else None
        bar = None
        if not self.quiet and self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=t.max_steps, initial=self.progress.step, unit="step", file=sys.stderr,
                       dynamic_ncols=True, mininterval=1.0)
        val_bpb = None
        started = time.perf_counter()
        wall0 = self.progress.wall_s
        try:
            while not self.should_stop():
                t0 = time.perf_counter()
                rec = self.train_step()
                dt = time.perf_counter() - t0
                self.progress.wall_s = wall0 + time.perf_counter() - started
                if not math.isfinite(rec["loss"]):
                    raise RuntimeError(f"non-finite loss {rec['loss']} at step {self.progress.step}")
                step, last = self.progress.step, self.should_stop()
                rec = {"step": step, "tokens": self.progress.tokens, "flops": self.progress.flops,
                       **rec, "tokens_per_s": t.batch_tokens / dt, "moe_max_over_mean": self._moe_balance()}
                if last or (t.eval_every and step % t.eval_every == 0):
                    val_bpb = rec["val_bpb"] = self.evaluate()
                if metrics is not None and (last or step % self.cfg.log.every == 0 or "val_bpb" in rec):
                    metrics.write(rec)
                if self.wandb is not None:
                    self.wandb.log({k: v for k, v in rec.items() if v is not None}, step=step)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", bpb=f"{val_bpb:.3f}" if val_bpb else "-",
                                    tok_s=f"{rec['tokens_per_s']:.0f}")
                if last or (t.checkpoint_every and step % t.checkpoint_every == 0):
                    self.checkpoint()
            if val_bpb is None:  # nothing left to train (e.g. resumed at the stop): evaluate for the summary
                val_bpb = self.evaluate()
        finally:
            if bar is not None:
                bar.close()
            if metrics is not None:
                metrics.close()
        summary = {"val_bpb": val_bpb, "steps": self.progress.step, "tokens": self.progress.tokens,
                   "flops": self.progress.flops, "wall_time_s": self.progress.wall_s,
                   "skip_rate": 0.0, "executed_fractions": self.executed_fractions(),
                   "flop_budget": t.flop_budget, "residual": self.cfg.model.residual,
                   "ffn": self.cfg.model.ffn}
        if self.rank == 0:
            write_summary(self.run_dir, summary)
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in summary.items() if v is not None})
            self.wandb.finish()
        self._log(f"done: step {self.progress.step}, val_bpb {val_bpb:.4f}, tokens {self.progress.tokens:,}")
        return summary
