"""The covering set's expert-parallel member (issue 38): the Trainer with parallel.ep=2 on 2 real gloo ranks under
CUDA's autocast rules (NAGMOE_CUDA_RULES=2.11), forward, backward and optimizer steps, with the kernel contracts
checked on every rank: bf16 x bf16 `_grouped_mm`, no fp32 activation larger than the carrier saved, and every
all-to-all payload of one dtype on both ranks; and (issue 39) every tensor of the steps created on its device."""
import os

import pytest

from gloo_ranks import run_on_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _rank_run(overrides, run_dir):
    os.environ["NAGMOE_CUDA_RULES"] = "2.11"  # the forkserver's ranks do not see the test's environment
    import torch

    from nagmoe.config import load_config
    from nagmoe.cuda_rules.contracts import KernelContracts, SavedActivationCheck
    from nagmoe.cuda_rules.placement import PlacementCheck
    from nagmoe.model.moe import MoELayer, Router
    from nagmoe.train.trainer import Trainer

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(repo, "configs/tiny.yaml"), overrides)
    trainer = Trainer(cfg, run_dir, quiet=True)
    contracts, saved = KernelContracts(), SavedActivationCheck(trainer.model, (MoELayer,), (Router,))
    with saved.active(), contracts, PlacementCheck() as placement:
        summary = trainer.run()
    layer = next(m for m in trainer.model.modules() if isinstance(m, MoELayer))
    return {"violations": contracts.violations + [str(v) for v in saved.violations], "placement": placement.report(),
            "grouped": sorted(set(contracts.grouped_mm_dtypes)), "steps": summary["steps"],
            "val_bpb": summary["val_bpb"], "dispatcher": repr(layer.dispatcher),
            "dtype_check": layer.dispatcher.check_payload_dtypes,
            "finite": all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters()),
            "precision": trainer.backends["precision"]}


def test_expert_parallel_trainer_under_cuda_rules(micro_overrides, tmp_path):
    overrides = [*micro_overrides, "parallel.ep=2", "model.moe.impl=grouped", "train.max_steps=3",
                 "model.mod.skip_rate=0.25", "train.eval_tokens=256"]
    results = run_on_ranks(_rank_run, 2, overrides, str(tmp_path / "run"))
    for rank, r in enumerate(results):
        assert r["violations"] == [], (rank, r["violations"][:3])
        assert r["placement"] == "", (rank, r["placement"])
        assert r["grouped"] == [("bfloat16", "bfloat16")] and r["steps"] == 3 and r["finite"], (rank, r)
        assert r["dtype_check"] and "AllToAllDispatcher(ep=2" in r["dispatcher"] and "CUDA's rules of torch 2.11" in r["precision"]
    assert results[0]["val_bpb"] == results[1]["val_bpb"]
