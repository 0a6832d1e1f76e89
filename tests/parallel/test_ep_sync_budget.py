"""Issue 26's sync budget under expert parallelism: on 2 real gloo ranks with parallel.ep=2, a training
micro-step of the tiny config reads the host exactly once per MoE layer (the all-to-all split sizes, both
directions in one copy) and nowhere else; with MoD on top, once more per MoD sublayer."""
import os

import pytest

from gloo_ranks import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.distributed


def count_on_rank(config):
    from nagmoe.config import load_config
    from nagmoe.parallel.mesh import ParallelMesh
    from nagmoe.train.sync_count import budget, count_micro_step

    cfg = load_config(os.path.join(REPO, config), ["parallel.ep=2", "model.mod.start_tokens=0",
                                                   "model.nag.warmup_tokens=0"])
    counter, model = count_micro_step(cfg, dtype="fp32", mesh=ParallelMesh.from_process_group(cfg))
    return {"by_file": counter.by_file(), "total": counter.total, "budget": budget(model, ep=2),
            "moe_layers": cfg.model.n_layers, "table": counter.table()}


@pytest.mark.parametrize("config", ["configs/tiny.yaml", "configs/tiny-mod20.yaml"])
def test_expert_parallel_reads_its_split_sizes_once_per_moe_layer(config):
    for r in run_on_ranks(count_on_rank, 2, config, timeout=120):
        ep_reads = r["by_file"].pop("nagmoe/parallel/expert_parallel.py")
        assert ep_reads == r["moe_layers"], r["table"]
        mod_reads = r["by_file"].pop("nagmoe/model/mod.py", 0)
        assert r["by_file"] == {} and r["total"] <= r["budget"] == r["moe_layers"] + mod_reads, r["table"]
        assert ("mod" in config) == (mod_reads > 0)
