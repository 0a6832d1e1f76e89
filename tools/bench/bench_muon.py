"""The Muon step at r40's shapes on 1, 2 and 4 gloo ranks: distributed Muon (issue 25, item 5) against today's.

    python tools/bench/bench_muon.py [--config configs/paper/nag-r40.yaml] [--layers 1] [--steps 1]
                               [--layouts 1x1,2x1r,2x1,4x1r,4x1,4x2r,4x2] [--out bench_muon.json]

Only Muon's parameters are built (names and shapes from the model built on the meta device, `--layers` of the
config's blocks; r40: per block c_q/c_k/c_v 128x512, c_proj 512x128, w_in 32x512x2048, w_out 32x2048x512), as
fp32 CPU tensors with random gradients; the time per step is extrapolated linearly to the config's depth.
Layouts `WxE[r][tT]`: W processes, parallel.ep=E, T torch threads per process (default 1):
  1xE   one process holding one EP rank's parameters (E=1: all): today's Muon, the work every rank repeats
  WxEr  W gloo ranks, DP W/E x EP E, today's Muon on every rank (each repeats its groups' work)
  WxE   the same ranks with distributed Muon (muon_replication of the real mesh): the replicated matrices
        split over all W ranks, each expert stack over its dp group of W/E ranks
Reported per layout: the step time (slowest rank, mean of the timed steps after one warm-up step that also
builds the plan), the time inside `orthogonalise` (slowest rank), the CPU time of the step (largest over ranks,
all threads of the process; the work a rank does, whatever else shares the cores), matrices orthogonalised per
rank, the bytes each rank receives in the exchange, all extrapolated to the config's depth, and the machine's
1-minute load average after the row (other jobs on the cores inflate the wall times, not the CPU times).
On a machine with fewer cores than W x T processes the ranks share cores (oversubscription): the split then
saves nothing beyond the core count, and the exchange (gloo over loopback TCP) competes with the compute.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_layout(text: str) -> dict:
    m = re.fullmatch(r"(\d+)x(\d+)(r?)(?:t(\d+))?", text.strip())
    if m is None:
        raise SystemExit(f"bad layout {text!r}: use WxE[r][tT] (e.g. 4x2, 4x2r, 1x1t2)")
    world, ep, threads = int(m.group(1)), int(m.group(2)), int(m.group(4) or 1)
    if world > 1 and world % ep:
        raise SystemExit(f"layout {text}: ep {ep} must divide the {world} ranks")
    distributed = world > 1 and not m.group(3)
    return {"name": text.strip(), "world": world, "ep": ep, "threads": threads, "distributed": distributed}


def muon_shapes(cfg):
    """(name, full shape, is_expert) of every Muon parameter of the model (built on the meta device)."""
    import torch

    from nagmoe.model import build_model
    from nagmoe.model.roles import MATRIX, param_roles
    from nagmoe.parallel.expert_parallel import EXPERT_PARAMS, moe_layers

    with torch.device("meta"):
        model = build_model(cfg.model)
    roles = param_roles(model)
    experts = {f"{mod}.{p}" for mod, _ in moe_layers(model) for p in EXPERT_PARAMS}
    return [(n, tuple(p.shape), n in experts) for n, p in model.named_parameters() if roles[n] == MATRIX]


def rank_main(rank, layout, port, args, queue):
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(layout["world"]), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch

        torch.set_num_threads(layout["threads"])
        from nagmoe.config import load_config
        from nagmoe.parallel.distributed_muon import muon_replication
        from nagmoe.parallel.env import init_distributed, read_dist_env, shutdown_distributed
        from nagmoe.parallel.mesh import ParallelMesh
        from nagmoe.train import optim

        world, ep = layout["world"], layout["ep"]
        init_distributed(read_dist_env(), torch.device("cpu"))
        cfg = load_config(args["config"], [f"model.n_layers={args['layers']}", f"parallel.ep={ep}"])
        mesh = ParallelMesh.build(cfg, rank, world) if world > 1 else None
        ep_rank = mesh.ep_rank if mesh is not None else 0
        gen = torch.Generator().manual_seed(rank)
        names, params, experts = [], [], []
        for name, shape, is_expert in muon_shapes(cfg):
            if is_expert and ep > 1:  # sharded over EP (as the trainer's shard_experts; ep 1: replicated)
                shape = (shape[0] // ep, *shape[1:])
                experts.append(name)
            names.append(name)
            params.append(torch.nn.Parameter(torch.randn(*shape, generator=gen) * 0.02))
        replication = muon_replication(mesh, experts) if layout["distributed"] else None
        muon = optim.Muon([dict(params=params, param_names=names)], lr=cfg.train.lr_matrix,
                          momentum=cfg.train.muon_momentum, weight_decay=cfg.train.weight_decay,
                          replication=replication)
        inner, kernel = optim.orthogonalise, [0.0]

        def timed_kernel(*a, **kw):
            t0 = time.perf_counter()
            out = inner(*a, **kw)
            kernel[0] += time.perf_counter() - t0
            return out

        optim.orthogonalise = timed_kernel
        steps, kernels, cpus = [], [], []
        for step in range(1 + args["steps"]):
            for p in params:  # the same gradients on the ranks of a group (seeded by EP rank and step)
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + ep_rank))
            if mesh is not None:
                mesh.barrier()
            kernel[0] = 0.0
            t0, c0 = time.perf_counter(), time.process_time()
            muon.step()
            steps.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            kernels.append(kernel[0])
        held = sum(p.numel() // (p.shape[-2] * p.shape[-1]) for p in params)
        done = muon.sharded.last_matrices if muon.sharded is not None else held
        received = 0
        if muon.sharded is not None:
            received = sum(ex.length * ex.group.size * ex.wire_dtype.itemsize for ex in muon.sharded._plan)
        queue.put((rank, {"step_s": steps[1:], "kernel_s": kernels[1:], "cpu_s": cpus[1:], "first_step_s": steps[0],
                          "held": held,
                          "orthogonalised": done, "received_bytes": received,
                          "replication": replication.describe() if replication is not None else None}))
        shutdown_distributed()
    except BaseException:
        import traceback

        queue.put((rank, {"error": traceback.format_exc()}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(layout: dict, args: dict) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, layout, port, args, queue)) for r in range(layout["world"])]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    for r, res in sorted(results.items()):
        if "error" in res:
            raise SystemExit(f"layout {layout['name']} rank {r} failed:\n{res['error']}")
    return [results[r] for r in range(layout["world"])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(REPO, "configs/paper/nag-r40.yaml"))
    ap.add_argument("--layers", type=int, default=1, help="blocks built (the time is scaled to the config's)")
    ap.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up step")
    ap.add_argument("--layouts", default="1x1,2x1r,2x1,4x1r,4x1,4x2r,4x2")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    from nagmoe.config import load_config

    depth = load_config(args.config, []).model.n_layers
    scale = depth / args.layers
    layouts = [parse_layout(t) for t in args.layouts.split(",")]
    conf = {"config": args.config, "layers": args.layers, "steps": args.steps}
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
           "config": os.path.relpath(args.config, REPO), "layers_built": args.layers, "depth": depth,
           "load_average_before": os.getloadavg()[0], "rows": []}
    print(f"{out['date']} {out['machine']}: {out['config']}, {args.layers} of {depth} blocks built, "
          f"times x{scale:g} to full depth; load average {out['load_average_before']:.1f}", flush=True)
    header = ("| layout | processes x threads | Muon | matrices held / orthogonalised per rank (full depth) | "
              "step s (full depth) | in orthogonalise s | CPU s per rank | received MB per rank | load |")
    print(header + "\n|---|---|---|---|---|---|---|---|---|", flush=True)
    for layout in layouts:
        started = time.perf_counter()
        ranks = run_layout(layout, conf)
        n = len(ranks[0]["step_s"])
        step = sum(max(r["step_s"][i] for r in ranks) for i in range(n)) / n
        kern = sum(max(r["kernel_s"][i] for r in ranks) for i in range(n)) / n
        cpu = sum(max(r["cpu_s"][i] for r in ranks) for i in range(n)) / n
        row = {**layout, "step_s": step * scale, "kernel_s": kern * scale, "cpu_s": cpu * scale,
               "measured_step_s": step,
               "held": ranks[0]["held"] * scale, "orthogonalised": [r["orthogonalised"] * scale for r in ranks],
               "received_mb": max(r["received_bytes"] for r in ranks) * scale / 1e6,
               "first_step_s": max(r["first_step_s"] for r in ranks) * scale,
               "replication": ranks[0]["replication"], "wall_s": time.perf_counter() - started,
               "load_average": os.getloadavg()[0]}
        out["rows"].append(row)
        kind = "distributed" if layout["distributed"] else "today"
        done = "/".join(f"{v:g}" for v in sorted(set(row["orthogonalised"])))
        print(f"| {layout['name']} (ep {layout['ep']}) | {layout['world']} x {layout['threads']} | {kind} | "
              f"{row['held']:g} / {done} | {row['step_s']:.1f} | {row['kernel_s']:.1f} | {row['cpu_s']:.1f} | "
              f"{row['received_mb']:.0f} | {row['load_average']:.1f} |", flush=True)
    out["load_average_after"] = os.getloadavg()[0]
    print(f"load average {out['load_average_after']:.1f} at the end (a busy machine slows every row)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
