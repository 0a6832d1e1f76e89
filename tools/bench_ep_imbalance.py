"""Expert parallelism under Mixture-of-Depths (issue 28, item 3): how uneven the all-to-all is with and without
MoD. Two real gloo ranks train the same config with `parallel.ep=2` — once at full depth (model.mod.skip_rate=0),
once with MoD — through the Trainer, on the offline Shakespeare corpus (prepared on first use), and every
training forward's all-to-all rows are counted per rank and MoE layer (`AllToAllDispatcher.take_traffic`, free:
the split sizes are read anyway).

    python tools/bench_ep_imbalance.py [--config configs/tiny-mod20.yaml --steps 40 --out ep.json] [overrides]

Per step and MoE layer: received rows (the slots this rank's experts compute) and sent rows (this rank's
executed tokens x top_k); the imbalance is max over ranks / mean over ranks — the slowest rank sets the step's
pace, so 1.0 is even and 1.2 means the busiest rank works 20% more than average. Reported as mean, p95 and max
over steps and layers, for received and sent rows, beside the mean executed share of MoE tokens per rank.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile

import torch
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench_output import emit_json  # noqa: E402  (tools/)

# MoD from the first step (no warm-up), so a short run measures the regime of a long one
MOD_NOW = ("model.mod.start_tokens=0", "model.nag.warmup_tokens=0")


def imbalance(per_rank: list) -> float:
    """max / mean of one quantity over ranks (1.0 when every rank has the same; 1.0 for all zeros)."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean > 0 else 1.0


def summarise(values: list) -> dict:
    ordered = sorted(values)
    return {"mean": statistics.fmean(ordered), "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
            "max": ordered[-1]}


def traffic_report(logs: list, top_k: int, tokens_per_rank_step: int) -> dict:
    """`logs[rank][step][layer]` = {"sent", "received", "calls"} -> the imbalance summary (module docstring)."""
    n_ranks, n_steps, n_layers = len(logs), len(logs[0]), len(logs[0][0])
    received, sent, executed = [], [], []
    for step in range(n_steps):
        for layer in range(n_layers):
            rows = [logs[r][step][layer] for r in range(n_ranks)]
            received.append(imbalance([x["received"] for x in rows]))
            sent.append(imbalance([x["sent"] for x in rows]))
            executed += [x["sent"] / top_k / tokens_per_rank_step for x in rows]
    total_sent = sum(x["sent"] for r in logs for s in r for x in s)
    total_received = sum(x["received"] for r in logs for s in r for x in s)
    return {"steps": n_steps, "moe_layers": n_layers, "ranks": n_ranks,
            "received_max_over_mean": summarise(received), "sent_max_over_mean": summarise(sent),
            "executed_share_of_moe_tokens": statistics.fmean(executed),
            "rows_conserved": total_sent == total_received}


def rank_run(cfg, run_dir: str) -> list:
    """Train `cfg` on this rank (a process group is up); per step, per MoE layer, this rank's traffic."""
    from nagmoe.parallel.expert_parallel import moe_layers
    from nagmoe.train.trainer import Trainer

    class CountingTrainer(Trainer):
        def train_step(self):
            for _, layer in moe_layers(self.model):
                layer.dispatcher.take_traffic()  # whatever ran before this step (evaluation runs under no_grad)
            rec = super().train_step()
            self.traffic_log.append([layer.dispatcher.take_traffic() for _, layer in moe_layers(self.model)])
            return rec

    trainer = CountingTrainer(cfg, run_dir, quiet=True)
    trainer.traffic_log = []
    trainer.run()
    return trainer.traffic_log


def measure(config: str, steps: int, overrides=(), work: str = None) -> dict:
    """On 2 ranks already in a process group: both variants, gathered to every rank."""
    import torch.distributed as dist

    from nagmoe.config import load_config

    work = work or tempfile.mkdtemp(prefix="ep_imbalance_")
    out = {}
    for name, extra in (("full_depth", ["model.mod.skip_rate=0"]), ("mod", [])):
        cfg = load_config(config, [*overrides, "parallel.ep=2", f"train.max_steps={steps}",
                                   f"train.schedule_steps={steps}", "train.eval_every=0", "train.checkpoint_every=0",
                                   "log.wandb=off", *MOD_NOW, *extra])
        log = rank_run(cfg, os.path.join(work, name))
        logs = [None] * dist.get_world_size()
        dist.all_gather_object(logs, log)
        tokens_per_rank_step = cfg.train.batch_tokens // dist.get_world_size()  # ranks split the batch (DP)
        out[name] = {"skip_rate": cfg.model.mod.skip_rate,
                     **traffic_report(logs, cfg.model.moe.top_k, tokens_per_rank_step)}
    return out


def _child(rank: int, port: int, config: str, steps: int, overrides: list, work: str, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from nagmoe.parallel.env import init_distributed, read_dist_env, shutdown_distributed

    init_distributed(read_dist_env(), torch.device("cpu"))
    try:
        result = measure(config, steps, overrides, work)
        if rank == 0:
            queue.put(result)
    finally:
        shutdown_distributed()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(REPO, "configs/tiny-mod20.yaml"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=None, help="write the JSON here (it is always printed)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)
    os.chdir(REPO)  # the configs' data paths are relative to the repository
    from nagmoe.config import load_config
    from nagmoe.data.prepare import ensure_prepared

    ensure_prepared(load_config(args.config, args.overrides))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    work = tempfile.mkdtemp(prefix="ep_imbalance_")
    procs = [ctx.Process(target=_child, args=(r, port, args.config, args.steps, args.overrides, work, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=3600)
    for p in procs:
        p.join()
    result = {"benchmark": "ep_imbalance", "config": os.path.relpath(args.config, REPO), "ep": 2,
              "backend": "gloo", "overrides": args.overrides, **result}
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
