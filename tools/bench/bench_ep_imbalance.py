"""Expert parallelism under Mixture-of-Depths (issue 28, item 3): how uneven the all-to-all is with and without
MoD. Two real gloo ranks train the same config with `parallel.ep=2` — once at full depth (model.mod.skip_rate=0),
once with MoD — through the Trainer, on the offline Shakespeare corpus (prepared on first use), and every
training forward's all-to-all rows are counted per rank and MoE layer (`AllToAllDispatcher.take_traffic`, free:
the split sizes are read anyway).

    python tools/bench/bench_ep_imbalance.py [--config configs/tiny-mod20.yaml --steps 40 --out ep.json] [overrides]

Per step and MoE layer: received rows (the slots this rank's experts compute) and sent rows (this rank's
executed tokens x top_k); the imbalance is max over ranks / mean over ranks — the slowest rank sets the step's
pace, so 1.0 is even and 1.2 means the busiest rank works 20% more than average. Reported as mean, p95 and max
over steps and layers, for received and sent rows, beside the mean executed share of MoE tokens per rank.

    python tools/bench/bench_ep_imbalance.py --balance [--ranks 4 --steps 40 --capacity-factors none 1.25]

Expert balancing (issue 43) at full depth on `--ranks` gloo ranks with parallel.ep = ranks: the loss-free expert
bias at γ in {0, 1e-3, 1e-2} (model.moe.expert_bias on; γ = 0 is the plain router) and a bench-only round-robin
routing control (token n's k-th slot goes to expert (n·K + k) mod E: perfectly even by construction), each
without and with a capacity factor. Per variant: the EP received-rows max/mean per (step, layer), the receive
peak of the router telemetry (the busiest rank's rows in one layer's all-to-all of one micro-step, over the
mean), the worst layer's expert max/mean over the run, the dropped share of slots, the bias's largest range,
and the mean step time (steps after the second; on a shared 2-core machine a 4-rank time is mostly contention).
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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench_output import emit_json  # noqa: E402  (tools/bench/)

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


ROUTINGS = {"gamma=0": 0.0, "gamma=0.001": 1e-3, "gamma=0.01": 1e-2, "round_robin": None}


def round_robin(layer) -> None:
    """Bench-only control: the layer routes token n's k-th slot to expert (n·K + k) mod E (its router's output
    times 0 is kept in the graph so every parameter still gets a gradient, as DDP expects)."""
    plain, E, K = layer.router.forward, layer.n_experts, layer.top_k

    def forward(x_ND):
        n = x_ND.shape[0]
        expert_NK = (torch.arange(n, device=x_ND.device).unsqueeze(1) * K + torch.arange(K, device=x_ND.device)) % E
        pattern_NE = torch.zeros(n, E, device=x_ND.device).scatter_(
            1, expert_NK, (10.0 - torch.arange(K, device=x_ND.device, dtype=torch.float32)).expand(n, K))
        return plain(x_ND) * 0.0 + pattern_NE

    layer.router.forward = forward


def balance_run(cfg, run_dir: str, steps: int, control: bool) -> dict:
    """Train `steps` steps on this rank; its traffic per step and layer, its step times and the run's router
    report (read once at the end: the whole run is one telemetry interval)."""
    import time

    from nagmoe.model.router_health import moe_layers as routed_layers
    from nagmoe.parallel.expert_parallel import moe_layers
    from nagmoe.train.trainer import Trainer

    trainer = Trainer(cfg, run_dir, quiet=True)
    if control:
        for layer in routed_layers(trainer.model):
            round_robin(layer)
    log, times = [], []
    try:
        for _ in range(steps):
            for _, layer in moe_layers(trainer.model):
                layer.dispatcher.take_traffic()
            started = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - started)
            log.append([layer.dispatcher.take_traffic() for _, layer in moe_layers(trainer.model)])
        report = trainer.routing.report(trainer.mesh.ep, trainer.model)
    finally:
        trainer.release_lease()
    return {"log": log, "times": times, "report": report}


def measure_balance(config: str, steps: int, overrides=(), work: str = None, capacity_factors=(None, 1.25),
                    routings=tuple(ROUTINGS)) -> dict:
    """On the ranks of a process group (parallel.ep = their number): every routing x capacity factor, gathered
    to every rank."""
    import torch.distributed as dist

    from nagmoe.config import load_config

    work = work or tempfile.mkdtemp(prefix="ep_balance_")
    world = dist.get_world_size()
    out = {}
    for routing in routings:
        rate = ROUTINGS[routing]
        for factor in capacity_factors:
            name = f"{routing}/capacity={'none' if factor is None else factor}"
            bias = [] if not rate else ["model.moe.expert_bias=true", f"model.moe.bias_update_rate={rate}"]
            cfg = load_config(config, [*overrides, f"parallel.ep={world}", f"train.max_steps={steps}",
                                       f"train.schedule_steps={steps}", "train.eval_every=0",
                                       "train.checkpoint_every=0", "log.wandb=off", "model.mod.skip_rate=0",
                                       f"model.moe.capacity_factor={'null' if factor is None else factor}", *bias])
            run = balance_run(cfg, os.path.join(work, name.replace("/", "_")), steps, routing == "round_robin")
            logs = [None] * world
            dist.all_gather_object(logs, run["log"])
            report = run["report"]
            traffic = traffic_report(logs, cfg.model.moe.top_k, cfg.train.batch_tokens // world)
            timed = run["times"][2:] or run["times"]
            out[name] = {
                "ep_received_max_over_mean": traffic["received_max_over_mean"],
                "receive_peak_over_mean": report.get("receive_peak_over_mean"),
                "receive_peak_rows": report.get("receive_peak_rows"),
                "expert_max_over_mean_worst_layer": report["max_over_mean_max"],
                "dropped_frac": statistics.fmean(report["dropped_frac"]),
                "bias_range_max": max(report["bias_range"]) if "bias_range" in report else None,
                "step_s": statistics.fmean(timed)}
    return out


def _child(rank: int, world: int, port: int, config: str, steps: int, overrides: list, work: str, queue,
           balance: dict = None) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from nagmoe.parallel.env import init_distributed, read_dist_env, shutdown_distributed

    init_distributed(read_dist_env(), torch.device("cpu"))
    try:
        result = (measure(config, steps, overrides, work) if balance is None
                  else measure_balance(config, steps, overrides, work, **balance))
        if rank == 0:
            queue.put(result)
    finally:
        shutdown_distributed()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(REPO, "configs/tiny-mod20.yaml"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=None, help="write the JSON here (it is always printed)")
    ap.add_argument("--balance", action="store_true", help="the expert-balancing study (issue 43), full depth")
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks (parallel.ep = ranks)")
    ap.add_argument("--capacity-factors", nargs="+", default=["none", "1.25"],
                    help="--balance: the capacity factors to run ('none' = dropless)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)
    if args.ranks < 2 or (not args.balance and args.ranks != 2):
        ap.error("--ranks must be >= 2 (and 2 without --balance)")
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
    balance = None if not args.balance else {
        "capacity_factors": [None if f == "none" else float(f) for f in args.capacity_factors]}
    procs = [ctx.Process(target=_child, args=(r, args.ranks, port, args.config, args.steps, args.overrides, work,
                                              queue, balance))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    result = queue.get(timeout=3600)
    for p in procs:
        p.join()
    result = {"benchmark": "ep_balance" if args.balance else "ep_imbalance",
              "config": os.path.relpath(args.config, REPO), "ep": args.ranks, "backend": "gloo",
              "steps": args.steps, "overrides": args.overrides, **result}
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
