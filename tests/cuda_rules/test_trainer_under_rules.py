"""The Trainer under CUDA's autocast rules on the CPU (NAGMOE_CUDA_RULES, issue 38): a covering set of families at
micro width runs forward, backward and optimizer steps, with the kernel contracts checked on every op. (EP on
2 gloo ranks: tests/parallel/test_ep_cuda_rules.py.)"""
import functools
import json
import os

import pytest
import torch

from nagmoe.cuda_rules.contracts import KernelContracts, SavedActivationCheck
from nagmoe.model.attention import MultiHeadAttention
from nagmoe.model.cca import CCAttention
from nagmoe.model.mlp import DenseMLP
from nagmoe.model.moe import MoELayer, Router
from nagmoe.rundir.metrics import read_metrics
from nagmoe.train.trainer import Trainer

pytestmark = pytest.mark.slow
SUBLAYERS = (MoELayer, DenseMLP, MultiHeadAttention, CCAttention)
# (name, overrides): NAG and pre-norm, MHA and CCA, dense and MoE (grouped, loop), MoD skipping, activation
# checkpointing; every run uses the chunked loss (train.precision=uniform) and takes optimizer steps
COVERING = [
    ("nag-cca-grouped-mod", ["model.attention.kind=cca", "model.moe.impl=grouped", "model.mod.skip_rate=0.25",
                             "train.max_steps=3"]),
    ("prenorm-mha-loop-ckpt", ["model.residual=prenorm", "model.attention.kind=mha", "model.moe.impl=loop",
                               "train.activation_checkpointing=true"]),
    ("nag-mha-dense", ["model.attention.kind=mha", "model.ffn=dense"]),
    ("prenorm-cca-grouped", ["model.residual=prenorm", "model.attention.kind=cca", "model.moe.impl=grouped"]),
]


@pytest.fixture
def cuda_rules(monkeypatch):
    monkeypatch.setenv("NAGMOE_CUDA_RULES", "2.11")


def _check_run(trainer, run_dir, extra):
    info = json.load(open(os.path.join(run_dir, "run_info.json")))
    assert info["autocast"]["cuda_rules"] == "2.11" and "CUDA's rules" in info["backends"]["precision"]
    records = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]
    assert records and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    if any("mod.skip_rate" in o for o in extra):
        assert records[-1]["skip_rate"] > 0  # the last step skipped tokens
    for p in trainer.model.parameters():  # the optimizer kept fp32 master weights
        assert p.dtype == torch.float32 and torch.isfinite(p).all()


@pytest.mark.parametrize("name,extra", COVERING, ids=[c[0] for c in COVERING])
def test_trainer_steps_under_cuda_rules_meet_the_contracts(micro_config, tmp_path, cuda_rules, name, extra):
    run_dir = str(tmp_path / name)
    trainer = Trainer(micro_config("train.max_steps=2", *extra), run_dir, quiet=True)
    contracts = KernelContracts()
    saved = SavedActivationCheck(trainer.model, SUBLAYERS, (Router,))
    with saved.active(), contracts:
        trainer.run()
    assert contracts.violations == [] and saved.violations == []
    if "grouped" in name:
        assert contracts.grouped_mm_dtypes and set(contracts.grouped_mm_dtypes) == {("bfloat16", "bfloat16")}
    _check_run(trainer, run_dir, extra)


def test_compiled_trainer_under_cuda_rules(micro_config, tmp_path, cuda_rules, monkeypatch):
    """Compiled sublayers (aot_eager) with activation checkpointing: `_grouped_mm`'s meta kernel refuses any
    operand that is not bf16, so the trace itself checks the contract."""
    import torch._dynamo

    import nagmoe.train.trainer as trainer_module
    from nagmoe.train.speed import compile_model

    monkeypatch.setattr(trainer_module, "compile_model", functools.partial(compile_model, backend="aot_eager"))
    torch._dynamo.reset()
    extra = ["model.moe.impl=grouped", "train.compile=true", "train.activation_checkpointing=true",
             "model.mod.skip_rate=0.25", "train.max_steps=3"]
    run_dir = str(tmp_path / "compiled")
    trainer = Trainer(micro_config(*extra), run_dir, quiet=True)
    trainer.run()
    assert trainer.backends["compile"].startswith("sublayers")
    _check_run(trainer, run_dir, extra)
    ran = json.load(open(os.path.join(run_dir, "run_info.json")))["backends_ran"]  # nothing recorded in a graph
    assert ran["experts"] == {"grouped (in the compiled graph)": 2} and ran["attention"] == {
        "sdpa (in the compiled graph)": 2}, ran
    torch._dynamo.reset()


def test_bad_rules_version_is_one_line_exit_2(micro_config, tmp_path, monkeypatch):
    from nagmoe.base.errors import UserError

    monkeypatch.setenv("NAGMOE_CUDA_RULES", "1.0")
    with pytest.raises(UserError, match="NAGMOE_CUDA_RULES"):
        Trainer(micro_config(), str(tmp_path / "run"), quiet=True)
    assert not os.path.exists(tmp_path / "run" / "config.yaml")  # nothing written
