"""Bytes one expert-parallel MoE layer sends through its all-to-alls per step, by direction and dtype (issue 38).

    python tools/bench/bench_ep_payload_bytes.py [--tokens 2048] [--d-model 256] [--experts 8] [--top-k 2]
                                                 [--hidden 512]

Two real gloo processes (EP 2), one forward and backward of one MoE layer (loop experts, which run on both sides
of issue 38's fix) under CPU bf16 autocast with CUDA's rules of torch 2.11. Every floating all-to-all payload is
recorded where it enters the functional collective, so the bytes are what the wire carries. Prints one JSON line:
the per-rank payload list (forward out, forward back, backward out, backward back) and the bytes per slot row in
units of D (2 bytes x D per direction when every payload is bf16).
"""
from __future__ import annotations

import argparse
import json
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, a: argparse.Namespace, out) -> None:
    from nagmoe.config import Config, MoEConfig
    from nagmoe.cuda_rules.contracts import AllToAllPayloads
    from nagmoe.cuda_rules.tier import cuda_rules_autocast
    from nagmoe.model.moe import MoELayer
    from nagmoe.parallel.expert_parallel import shard_experts
    from nagmoe.parallel.mesh import ParallelMesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = Config()
        cfg.model.ffn, cfg.model.moe.n_experts, cfg.parallel.ep = "moe", a.experts, world
        torch.manual_seed(0)
        layer = MoELayer(a.d_model, MoEConfig(n_experts=a.experts, top_k=a.top_k, expert_hidden=a.hidden,
                                              impl="loop"))
        shard_experts(layer, ParallelMesh.build(cfg, rank, world))
        x = torch.randn(1, a.tokens, a.d_model, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        log = AllToAllPayloads()
        with log:
            with cuda_rules_autocast("2.11"):
                y, _ = layer(x)
            y.float().sum().backward()
        traffic = layer.dispatcher.take_traffic()
        out.put((rank, {"payloads": log.seen, "sent": traffic["sent"], "received": traffic["received"]}))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, a, out)) for r in range(2)]
    for p in procs:
        p.start()
    ranks = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    total = sum(b for r in ranks.values() for _, b in r["payloads"])
    rows = sum(r["sent"] for r in ranks.values())  # slot rows dispatched, both ranks (= received)
    print(json.dumps({"tokens_per_rank": a.tokens, "d_model": a.d_model, "experts": a.experts, "top_k": a.top_k,
                      "ranks": [ranks[r] for r in sorted(ranks)], "total_bytes": total,
                      "bytes_per_slot_row_in_D": round(total / (rows * a.d_model), 3)}))


if __name__ == "__main__":
    main()
