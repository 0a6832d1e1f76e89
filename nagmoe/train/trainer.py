"""The training loop: global batch with gradient accumulation, FLOP-budget stop, LR horizon, eval, checkpoints
with exact resume, metrics.

Step accounting. `step` counts completed optimizer steps. The metrics record of step N, the checkpoint
`step_N` and the LR of the step after it all refer to the state after N steps. Each step consumes
`train.batch_tokens` tokens and `flops_per_token(model, seq_len, executed) * batch_tokens` training FLOPs.
Stop: when `step == train.max_steps`, or when the next step would take the cumulative FLOPs more than half a
step past `train.flop_budget` (so the run ends within half a step of the budget).

Distributed (`mesh`, nagmoe.parallel): every rank is a data rank reading its own shard of each global batch;
replicated parameters go through DDP (no sync on accumulation micro-steps), expert stacks are sharded over
the EP ranks and their gradients summed over the ranks that replicate them (nagmoe.parallel.grad_sync).
Everything that decides the control flow agrees over ranks, mostly without a collective of its own: the stop is
the same arithmetic on identical numbers (MoD's executed fractions come from counts summed with its histograms),
the non-finite guard agrees through the gradient all-reduce, and the rest (preemption, the checkpoint clock, the
lease, the logged loss) travels in one all-reduce at sync and metrics steps (nagmoe/train/step_decisions.py).
Files are written by rank 0; checkpoints are collective. One process runs exactly the single-device code path.
"""
from __future__ import annotations

import math
import os
import socket
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from nagmoe.config import Config
from nagmoe.data import shards
from nagmoe.data.loader import TokenLoader, TokenShards, check_data_vocab
from nagmoe.data.prefetch import PrefetchLoader
from nagmoe.data.bpb import token_bytes
from nagmoe.base.errors import UserError
from nagmoe.config.flops import flops_per_token
from nagmoe.model import build_model
from nagmoe.train.deepspeed_engine import DeepSpeedEngine
from nagmoe.parallel.expert_parallel import expert_shard_plan, shard_experts
from nagmoe.parallel.grad_sync import clip_grad_norm_, named_params, sync_expert_grads, wrap_ddp
from nagmoe.parallel.mesh import ParallelMesh
from nagmoe.parallel.env import rank_hosts
from nagmoe.checkpoint import load_checkpoint
from nagmoe.model.moe import GlobalBalance
from nagmoe.model.router_health import moe_layers
from nagmoe.train.mod_accounting import ModAccount
from nagmoe.train.router_accounting import RouterAccounting
from nagmoe.base.environment import check_start_settings, describe_environment
from nagmoe.train.export_at_end import check_available as check_export_available, export_at_end
from nagmoe.train.trainer_run_dir import TrainerRunDir
from nagmoe.train.wandb_mode import start_wandb
from nagmoe.train.optim import build_optimizers
from nagmoe.data.host_copy import to_device
from nagmoe.train.guards import EXIT_GATE_COLLAPSE, TrainingHalted, fail_at_step_for_a_test, is_nonfinite
from nagmoe.train.preemption import PreemptionWatch
from nagmoe.parallel.progress_board import default_board
from nagmoe.train.hang_watchdog import start_watchdog
from nagmoe.train.precision_context import TrainingPrecision, reusable_autocast
from nagmoe.rundir.info import update_run_info, write_summary
from nagmoe.train.backends_ran import collect as collect_backends_ran, merge as merge_backends_ran
from nagmoe.train.schedule import injection_warmup, lr_multiplier
from nagmoe.train.memory import eager_memory_refusal, micro_batch_rows, plan_loss_recompute
from nagmoe.train.gc_control import LoopGC
from nagmoe.train.loop_log import LoopLog
from nagmoe.train.step_decisions import StepDecisions, poison_term
from nagmoe.train.validation import validation_bpb
from nagmoe.train.speed import compile_model, enable_activation_checkpointing, resolve_compile
from nagmoe.train.backend_report import describe_backends
from nagmoe.train.trainer_checkpoints import TrainerCheckpoints
from nagmoe.train.trainer_guards import TrainerGuards


@dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    flops: float = 0.0
    wall_s: float = 0.0  # training wall time summed over resumes
    nonfinite_skipped: int = 0  # steps whose update was dropped (train.nonfinite=skip; nagmoe.train.guards)
    mod_account: Optional[dict] = None  # MoD's realised skipping over the run (nagmoe.train.mod_accounting)

    def as_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "flops": self.flops, "wall_s": self.wall_s,
                "nonfinite_skipped": self.nonfinite_skipped, "mod_account": self.mod_account}


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device: cuda was asked for but no CUDA device is visible")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested)


class Trainer(TrainerGuards, TrainerCheckpoints):
    """The run: set-up (`__init__`), the step (`train_step`), the loop (`run`); the guards' verdicts are
    trainer_guards.py, the saves trainer_checkpoints.py, what the ranks decide between steps step_decisions.py,
    the records loop_log.py."""
    in_loop: bool = False  # inside `run`: train_step leaves the metrics to the loop's exchanges
    progress_mode: Optional[str] = None  # `nagmoe train --progress`: auto | lines | off; None: off if quiet, else auto

    def __init__(self, cfg: Config, run_dir: str, accept_config_change: bool = False, take_over: bool = False,
                 start_over: bool = False, quiet: bool = False, rank: int = 0, world_size: int = 1,
                 mesh: Optional[ParallelMesh] = None, eager_memory_estimate: Optional[int] = None):
        """`mesh`: the distributed layout (nagmoe.parallel.mesh.ParallelMesh). Without one: the initialised
        process group's layout when there is one and `world_size` is left at 1, else `rank`/`world_size`.
        The three permissions are `nagmoe train`'s flags of the same names (nagmoe/rundir/permissions.py).
        `eager_memory_estimate`: bytes per rank of a memory estimate made ahead for this layout (the eager upper
        bound), for the refusal of an eager CUDA layout that cannot fit and, compiled on CUDA, the loss's choice to
        keep its chunks' logits (None: estimated here, up to a minute of CPU at paper width)."""
        check_start_settings()  # every NAGMOE_* setting and job variable: one line now, not hours in
        check_export_available(cfg)  # train.export_hf_at_end needs the hf extra: say so before training
        if cfg.parallel.engine == "deepspeed" and cfg.train.checkpoint_async == "on":
            raise UserError("train.checkpoint_async: on is not supported by parallel.engine=deepspeed (DeepSpeed "
                            "writes its own files, synchronously); use auto or off")
        self.cfg, self.run_dir, self.quiet = cfg, run_dir, quiet
        t, m = cfg.train, cfg.model
        self.device = resolve_device(t.device)
        # bf16 autocast on CUDA; on the CPU fp32, or bf16 under CUDA's rules with NAGMOE_CUDA_RULES (issue 38)
        self.precision = TrainingPrecision(self.device.type)
        self.backends_ran: dict = {}  # what the steps ran, merged (nagmoe/train/backends_ran.py)
        self.autocast = reusable_autocast(self.precision)
        if mesh is None and world_size == 1:
            mesh = ParallelMesh.from_process_group(cfg, self.device.type)
        elif mesh is None:
            mesh = ParallelMesh.build(cfg, rank, world_size, device_type=self.device.type)
        self.mesh = mesh
        self.rank, self.world_size = rank, world_size = mesh.rank, mesh.world_size
        if self.device.type == "cuda" and mesh.distributed:
            self.device = torch.device("cuda", mesh.local_rank)
        seq = cfg.data.seq_len
        self.global_rows = t.batch_tokens // seq
        if self.global_rows % world_size:
            raise UserError(f"train.batch_tokens: {self.global_rows} rows do not split over {world_size} ranks")
        rank_rows = self.global_rows // world_size
        self.micro_rows = micro_batch_rows(cfg, world_size)
        if rank_rows % self.micro_rows:
            raise UserError(f"train.micro_batch_tokens: {self.micro_rows} rows per micro-step do not divide "
                            f"the {rank_rows} rows of this rank")
        self.accum = rank_rows // self.micro_rows
        self.compiled = resolve_compile(t.compile, self.device.type)  # train.compile: auto = on for CUDA
        if self.device.type == "cuda" and not self.compiled:  # eager on CUDA: refuse a layout that cannot fit
            refusal = eager_memory_refusal(cfg, torch.cuda.get_device_properties(self.device).total_memory,
                                           mesh.ep, world_size, eager_memory_estimate)
            if refusal is not None:
                raise UserError(refusal)

        self._check_data()
        self.routing = RouterAccounting()  # per step, per log interval, the expert bias's update
        # the metrics read after the optimizer step (issue 60, `_train_step`): None = on CUDA; True / False forces
        self.metrics_read_after: Optional[bool] = None
        self.data_wait_s = 0.0  # the last step's wait for its batches (nagmoe/train/loop_clock.py)
        self.rundir = TrainerRunDir(run_dir, mesh, self._log)  # the order of every read and write: its docstring
        self.rundir.take_lease(take_over)
        try:
            latest = self.rundir.open(cfg, start_over, accept_config_change)

            torch.manual_seed(t.seed)
            from nagmoe.model.init_rng import init_model

            with torch.device("meta"):  # the structure only: no rank allocates the whole model (issue 25) ...
                self.model = build_model(m)
            self.expert_names = shard_experts(self.model, mesh)  # ... each EP rank keeps its experts (still meta)
            if self.precision.rules:  # CUDA's rules on the CPU are a debug run: check the EP payloads' dtypes too
                for layer in self.model.modules():
                    if getattr(layer, "dispatcher", None) is not None:
                        layer.dispatcher.check_payload_dtypes = True
            # ... and draws only what it holds, each parameter (expert) from its (train.seed, name, global expert)
            # generator: every EP layout and device starts from the same weights (nagmoe/model/init_rng.py)
            init_model(self.model, t.seed, self.device)
            self.model.set_mod_seq_len(cfg.data.seq_len)  # MoD's work weights: what the budget charges
            self.model.set_precision(t.precision)  # one policy for both residual streams (docs/architecture.md)
            if self.device.type == "cuda" and t.precision == "uniform":  # the fp32 matmuls left: TF32
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
            if t.activation_checkpointing:  # nagmoe/train/speed.py
                enable_activation_checkpointing(self.model)
            compiled = compile_model(self.model) if self.compiled else None  # nagmoe/train/speed.py
            if compiled and self.device.type == "cuda":  # issue 60: keep the loss chunks' logits where they fit
                self.model.loss_recompute, loss_plan = plan_loss_recompute(
                    cfg, torch.cuda.get_device_properties(self.device).total_memory, mesh.ep, world_size,
                    eager_memory_estimate)
                self._log(loss_plan)
            self.expert_params = named_params(self.model, self.expert_names)
            self.shard_plan = expert_shard_plan(mesh, self.expert_names)
            # parallel.engine=deepspeed: ZeRO for the replicated parameters, our EP and AdamW for the experts
            self.engine = (DeepSpeedEngine(self.model, self.expert_names, mesh, cfg, self.micro_rows, self.accum)
                           if cfg.parallel.engine == "deepspeed" else None)
            if self.engine is not None:
                self.optim = self.engine.optim
            elif t.optimizer == "adamw":  # AdamW for every role: the DeepSpeed engine's optimizer, on torch
                from nagmoe.train.deepspeed_engine import build_adamw_optimizers

                self.optim = build_adamw_optimizers(self.model, t)
            else:  # distributed Muon: the ranks replicating a matrix split its Newton-Schulz work
                from nagmoe.parallel.distributed_muon import muon_replication

                self.optim = build_optimizers(self.model, t, replication=muon_replication(mesh, self.expert_names))
            verify = cfg.data.verify_shards
            # the epoch's skipped tail is per optimizer step, so every rank/micro-batch split sees the same tokens
            # ... read data.prefetch batches ahead by a thread (pinned on CUDA): the same batches, and the position
            # saved is the one consumed (nagmoe/data/prefetch.py); Trainer.run closes it
            self.loader = self._prefetch = PrefetchLoader(
                TokenLoader(cfg.data.data_dir, "train", seq, self.micro_rows, t.seed, rank, world_size,
                            verify=verify, step_rows=self.global_rows),
                depth=cfg.data.prefetch, pin=self.device.type == "cuda", device=self.device)
            self.val_shards = TokenShards(cfg.data.data_dir, "val", verify=verify)
            self.token_bytes = token_bytes(cfg.data.data_dir)
            self.progress = Progress()
            if latest is not None:
                started = time.perf_counter()  # `latest` was verified by resume_checkpoint: one hash pass per load
                state = (self.engine.load_checkpoint(latest, verified=True) if self.engine is not None
                         else load_checkpoint(latest, self.model, self.optim, shard_plan=self.shard_plan,
                                              verified=True, rng_seed=t.seed))
                self._log(f"loaded {latest} in {time.perf_counter() - started:.1f} s")
                self.progress = Progress(**state["progress"])
                self.routing.load_extra_state(state, self.model, latest)
                self.loader.load_state_dict(state["loader"])
                self._log(f"resumed from {latest} at step {self.progress.step}")
            calibrator = self.model.mod_calibrator()
            self.mod_account = None if calibrator is None else ModAccount(
                m, cfg.data.seq_len, calibrator, self.progress.mod_account, self.progress.step,
                t.flop_convention)
            self.rundir.truncate_metrics(self.progress.step)
            # DDP for the replicated parameters (after the load: its start-up broadcast then changes nothing)
            self.ddp = (wrap_ddp(self.model, mesh, self.expert_names) if mesh.distributed and self.engine is None
                        else None)
            self.replicated_params = [p for n, p in self.model.named_parameters() if n not in set(self.expert_names)]
            # the loss sums: reduced every step only where DeepSpeed's guard needs them before its step, else at
            # metrics steps; the non-finite guard's agreement rides DDP's gradient all-reduce through the
            # smallest replicated parameter (step_decisions.poison_term)
            self.sums_global = self.engine is not None or not mesh.distributed
            trainable = [p for p in self.replicated_params if p.requires_grad]
            self.poison_param = (min(trainable, key=lambda p: p.numel()) if self.ddp is not None and trainable
                                 else None)
            self.backends = describe_backends(self.model, compiled, self.device, t.precision, self.precision.rules)
            self.background_save = self.background_saves()  # train.checkpoint_async (collective when on)
            hosts = rank_hosts()  # every rank (a collective)
            self.rundir.write_run_info(self.backends, str(self.device),
                                       {"resumed_from": latest, "grad_accum": self.accum, "world_size": world_size,
                                        "hosts": hosts, "ep": mesh.ep, "dp": mesh.dp, "engine": cfg.parallel.engine,
                                        "autocast": self.precision.describe(),
                                        **({"deepspeed": self.engine.describe()} if self.engine is not None else {})})
            self._log(f"device {self.device}; backends: {self.backends}; grad accumulation {self.accum}")
            if self.rank == 0:  # also under --quiet (job scripts): the job log says what ports and threads it ran on
                print(f"[nagmoe] environment: {describe_environment()}", file=sys.stderr, flush=True)
            self.wandb = start_wandb(self.cfg, self.run_dir) if self.rank == 0 else None
        except BaseException:
            self.release_lease()
            raise

    # ------------------------------------------------------------------------------------------------------
    def fence(self) -> None:
        """Collective, before each checkpoint publish, metrics write and summary.json (TrainerRunDir.fence)."""
        self.rundir.fence()

    def release_lease(self) -> None:
        """Give the run dir back (rank 0 holds the lease); idempotent."""
        self.rundir.release()

    def _log(self, msg: str) -> None:
        if not self.quiet and self.rank == 0:
            print(f"[nagmoe] {msg}", file=sys.stderr, flush=True)

    def _check_data(self) -> None:
        d = self.cfg.data.data_dir
        index_path = os.path.join(d, shards.INDEX)
        if not os.path.isfile(index_path):
            raise UserError(f"{index_path}: no prepared data; run `nagmoe prepare-data --config ...` first")
        check_data_vocab(d, self.cfg.model.vocab_size)

    def executed_fractions(self) -> Optional[list]:
        """The realised executed fraction per sublayer (MoD) of the last step, or None for full depth (and
        before the first step). `model.mod_update` sums the step's counts over ranks (integer-valued float64:
        exact), so on every rank these are the global batch's fractions, identical to the bit: what prices a
        step and so the FLOP-budget stop need no collective (nagmoe/train/step_decisions.py)."""
        return getattr(self, "mod_executed", None)

    @staticmethod
    def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
        """All-reduce SUM for MoD's score histograms, so every rank sets the same thresholds."""
        import torch.distributed as dist

        dist.all_reduce(t)
        return t

    def step_flops(self) -> float:
        return flops_per_token(self.cfg.model, self.cfg.data.seq_len, self.executed_fractions(),
                               self.cfg.train.flop_convention) * self.cfg.train.batch_tokens

    def should_stop(self) -> bool:
        """The stop, the same on every rank without a collective (the same arithmetic on the same numbers:
        nagmoe/train/step_decisions.py; each exchange checks that the ranks agree on the step)."""
        t = self.cfg.train
        stop = t.max_steps is not None and self.progress.step >= t.max_steps
        if not stop:
            stop = t.flop_budget is not None and self.progress.flops + 0.5 * self.step_flops() > t.flop_budget
        return stop

    # ------------------------------------------------------------------------------------------------------
    def evaluate(self, final: bool = False) -> float:
        """Validation bpb on the eval sample: `train.eval_tokens` of it at the end (`final`, the per-window losses
        kept in the run dir for paired comparisons), `train.eval_tokens_during` in the loop."""
        with self.precision.scope():
            return validation_bpb(self, final)

    def train_step(self) -> dict:
        """One optimizer step (forward, backward, optimizer), under CUDA's rules when asked for. Distributed, a
        direct caller gets the record's loss, aux loss and worst expert load over every rank (and the router's
        telemetry summed) in one collective; inside `run` (`in_loop`) they stay this rank's, reduced at the loop's
        metrics steps only (nagmoe/train/step_decisions.py)."""
        with self.precision.scope():
            rec = self._train_step()
        self._note_backends_ran()
        if not self.in_loop and self.mesh.distributed:
            StepDecisions(self).exchange(self.progress.step, False, True, True).into(rec, self.accum)
        return rec

    def _train_step(self) -> dict:
        t, m = self.cfg.train, self.cfg.model
        p = self.progress
        lr_mult = lr_multiplier(p.step, p.flops, t)
        self.optim.set_lr_multiplier(lr_mult)
        warm = injection_warmup(p.tokens, m.nag.warmup_tokens) if m.residual == "nag" else 1.0
        self.model.set_injection_warmup(warm)
        # the step's metrics stay on the device until one read after the optimizer step (issue 26)
        loss_sum = aux_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        model = self.engine if self.engine is not None else self.ddp if self.ddp is not None else self.model
        self.routing.begin_step()  # this step's routing, summed over its micro-batches
        # model.moe.lb_granularity=global_batch: the balance loss from the step's counts over every rank so far
        balance = GlobalBalance() if m.ffn == "moe" and m.moe.lb_granularity == "global_batch" else None
        self.data_wait_s = 0.0
        for i in range(self.accum):
            waited = time.perf_counter()
            x, y = next(self.loader)
            x, y = to_device(x, self.device), to_device(y, self.device)  # pinned, non-blocking on CUDA
            self.data_wait_s += time.perf_counter() - waited
            # DDP all-reduces in the backward of the last micro-step only
            skip_sync = self.ddp is not None and i < self.accum - 1
            with self.ddp.no_sync() if skip_sync else nullcontext():
                with self.autocast:
                    out = model(x, y)
                self.routing.add(self.model, self.rank, self.world_size)
                aux = out.aux_loss
                if balance is not None:  # one stacked all-reduce per micro-step, after the forward
                    aux = aux + balance.loss(moe_layers(self.model),
                                             self._sum_over_ranks if self.mesh.distributed else None)
                if self.engine is not None:  # DeepSpeed divides by the micro-steps, reduces on the last one
                    self.engine.backward(out.loss + aux, boundary=i == self.accum - 1)
                else:
                    total = (out.loss + aux) / self.accum
                    if self.poison_param is not None and i == self.accum - 1:  # the guard's agreement, below
                        seen = loss_sum + aux_sum + out.loss.detach().float() + aux.detach().float()
                        total = total + poison_term(seen, self.poison_param)
                    total.backward()
            loss_sum = loss_sum + out.loss.detach().float()
            aux_sum = aux_sum + aux.detach().float()
        self._last_batch = (x, y)  # the guards re-run it (non-finite scan, gate statistics)
        sums = torch.stack([loss_sum, aux_sum])
        # Every rank takes the same guard decisions. The torch engine: with no collective of their own (a rank's
        # non-finite loss poisoned the gradients every rank's norm reads, step_decisions.poison_term); the
        # logged mean over ranks is taken at metrics steps only. DeepSpeed's guard reads the loss before its
        # step: the mean over ranks every step.
        if self.sums_global and self.mesh.distributed:
            sums = self.mesh.mean_tensor(sums)
        self.step_sums = sums
        worst_load = self.routing.end_step(self.mesh.distributed,
                                           every_step=m.ffn == "moe" and m.moe.expert_bias)
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        if self.engine is not None:  # DeepSpeed: the guard before its own step needs the loss first
            loss_sum, aux_sum = sums.tolist()
            if is_nonfinite(loss_sum + aux_sum, 0.0):
                self._nonfinite(loss_sum / self.accum, float("nan"), halt=True)
        if self.engine is not None:  # clip by the global norm, ZeRO's and the experts' AdamW steps
            grad_norm = self.engine.step()
        elif self.expert_params:  # EP: expert gradients over their replicas, then the global norm
            sync_expert_grads(self.expert_params, self.mesh)
            grad_norm = clip_grad_norm_(self.replicated_params, self.expert_params, max_norm, self.mesh)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        grad_norm = torch.as_tensor(grad_norm, dtype=torch.float64, device=sums.device).view(1)
        # Read after the step (issue 60): the optimizer's kernels are launched before the host waits for the
        # metrics, the guard decided on the device (ok: the same test as is_nonfinite, in float64), the step
        # applied only where ok (OptimizerBundle.step). Default on CUDA; the CPU (synchronous anyway) keeps
        # the read before the step, its numerics unchanged; `metrics_read_after` (True / False) forces either.
        read_after = self.device.type == "cuda" if self.metrics_read_after is None else self.metrics_read_after
        read_after = read_after and self.engine is None and self.optim.device_guard
        ok = None
        if read_after:
            ok = torch.isfinite(sums.double().sum()) & torch.isfinite(grad_norm[0])
            self.optim.step(ok=ok)
        # the step's one metrics read: loss, aux loss, gradient norm, the worst expert load
        values = torch.cat([sums.double(), grad_norm,
                            (worst_load if worst_load is not None else torch.zeros(1, device=sums.device))
                            .double().view(1).to(sums.device)]).tolist()
        loss_sum, aux_sum, grad_norm = values[:3]
        worst_load = values[3] if worst_load is not None else None
        # the non-finite guard: nothing non-finite reaches the weights or the optimizer state
        skipped = is_nonfinite(loss_sum + aux_sum, grad_norm)
        if skipped:  # halts (TrainingHalted, exit 3) unless train.nonfinite=skip
            self._nonfinite(loss_sum / self.accum, grad_norm, halt=self.engine is not None)
        if self.engine is None:
            if not skipped and not read_after:
                self.optim.step()
            self.optim.zero_grad(set_to_none=True)
        if not skipped and m.ffn == "moe" and m.moe.expert_bias:
            self.routing.update_bias(self.model)  # once per taken step, from the global batch's counts
        # MoD: this step's scores set the next step's thresholds; its realised fractions price this step
        self.mod_executed = self.model.mod_update(self._sum_over_ranks if self.mesh.distributed else None)
        p.flops += self.step_flops()
        p.step += 1
        p.tokens += t.batch_tokens
        mod = {}
        if self.mod_account is not None:
            mod = self.mod_account.record(t.batch_tokens)
            p.mod_account = self.mod_account.state
        guard = {"nonfinite_skipped": p.nonfinite_skipped} if t.nonfinite == "skip" else {}
        return {"loss": loss_sum / self.accum, "aux_loss": aux_sum / self.accum, "lr": t.lr_matrix * lr_mult,
                "lr_mult": lr_mult, "grad_norm": grad_norm, "injection_warmup": warm,
                # the factor clipping scaled the gradients by (torch's rule: max_norm / (norm + 1e-6), at most 1)
                "clip_coef": (min(1.0, max_norm / (grad_norm + 1e-6)) if math.isfinite(max_norm)
                              and math.isfinite(grad_norm) else None),
                "moe_max_over_mean": worst_load, **mod, **guard}

    def _note_backends_ran(self) -> None:
        """run_info.json's `backends_ran`: what the steps so far actually ran, rewritten when something new ran."""
        if merge_backends_ran(self.backends_ran, collect_backends_ran(self.model)) and self.rank == 0:
            update_run_info(self.run_dir, "backends_ran", self.backends_ran)

    def run(self) -> dict:
        """Train to the stop; the run dir's lease is released at the end, however it ends."""
        try:
            with self.precision.scope():  # CUDA's rules on the CPU, when asked for: the whole run
                return self._run()
        finally:
            self._prefetch.close()  # no prefetch thread left, however the run ends
            if getattr(self, "background_save", None) is not None:
                self.background_save.close()  # a save still in flight is not published unless complete
            self.release_lease()

    def _run(self) -> dict:
        """The step sequence; what every rank decides between steps and what it costs: step_decisions.py; the
        records: loop_log.py."""
        t = self.cfg.train
        loop = LoopLog(self, self.progress_mode or ("off" if self.quiet else "auto"))
        val_bpb = None
        self._schedule = None
        self.checkpoint_schedule()  # time-based saves count from here
        started = time.perf_counter()
        wall0 = self.progress.wall_s
        preemption = PreemptionWatch(self.run_dir, self.rank).install()  # SIGUSR1/SIGTERM or a request file
        decisions = StepDecisions(self, preemption)
        # every rank's last step and heartbeat in the rendezvous store: a failure line names who fell silent
        board = default_board(self.rank, self.world_size, socket.gethostname())
        watchdog = start_watchdog(self.rank, t.hang_timeout_s, self.progress.step,  # a hang ends in bounded time
                                  board=board.start(self.progress.step) if board is not None else None)
        loop_gc = LoopGC(t.gc_every).__enter__()  # set-up frozen, collections every gc_every steps (gc_control.py)
        self.in_loop = True
        try:
            while not self.should_stop():  # local: the same step on every rank (step_decisions.py)
                t0 = time.perf_counter()
                flops_before = self.progress.flops
                rec = self.train_step()
                dt = time.perf_counter() - t0
                loop.clock.step_done(dt, self.data_wait_s)
                watchdog.step_done(self.progress.step, dt)
                fail_at_step_for_a_test(self.progress.step)
                self.progress.wall_s = wall0 + time.perf_counter() - started
                step, last = self.progress.step, self.should_stop()
                rec = {"step": step, "tokens": self.progress.tokens, "flops": self.progress.flops, **rec}
                gate_stop = self._gate_check(rec)  # the gate-collapse alarm: a warning and metrics fields
                if last or (t.eval_every and step % t.eval_every == 0):
                    with watchdog.phase("an evaluation"):
                        val_bpb = rec["val_bpb"] = self.evaluate(final=last)
                sync, shared = loop.record(rec, decisions, step, last, dt)  # the exchange; lines written at syncs
                if sync and shared.settle_save:  # a background save every rank finished, or one that failed
                    self.settle_saves()
                loop.show(rec, self.progress.flops - flops_before, last, val_bpb)
                self.save_point(step, last, gate_stop, sync, shared, loop, watchdog, preemption)
                loop_gc.step_done(step)  # the same step on every rank
                if gate_stop:
                    raise TrainingHalted(f"stopped by the gate-collapse alarm at step {step} (checkpoint "
                                         "written)", EXIT_GATE_COLLAPSE)
            if val_bpb is None:  # nothing left to train (e.g. resumed at the stop): evaluate for the summary
                val_bpb = self.evaluate(final=True)
        except TrainingHalted:  # every rank halts together (guards.py): the lines up to the halt are kept
            self.fence()
            loop.flush()
            self.settle_saves()
            raise
        except RuntimeError as exc:  # a gloo collective past its timeout: one line naming rank, host, step
            halt = watchdog.timed_out(exc)
            if halt is None:
                raise
            raise halt from exc
        finally:
            self.in_loop = False
            loop_gc.__exit__(None, None, None)
            watchdog.stop()
            preemption.uninstall()
            loop.close()
        summary = {"val_bpb": val_bpb, "steps": self.progress.step, "tokens": self.progress.tokens,
                   "flops": self.progress.flops, "wall_time_s": self.progress.wall_s,
                   "skip_rate": 0.0, "executed_fractions": self.executed_fractions(),
                   "flop_budget": t.flop_budget, "residual": self.cfg.model.residual,
                   "ffn": self.cfg.model.ffn}
        if self.mod_account is not None:  # MoD: realised skipping (skipping steps, and the whole run)
            summary.update(self.mod_account.summary())
        self.fence()
        if self.rank == 0:
            write_summary(self.run_dir, summary)
        if self.wandb is not None:
            self.wandb.summary.update({k: v for k, v in summary.items() if v is not None})
            self.wandb.finish()
        self._log(f"done: step {self.progress.step}, val_bpb {val_bpb:.4f}, tokens {self.progress.tokens:,}")
        if t.export_hf_at_end and self.rank == 0:  # after the final checkpoint; a failure only warns
            export_at_end(self.run_dir, self.quiet)
        return summary
