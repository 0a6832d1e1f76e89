"""Device placement (issue 39): nothing a training step creates is made on the host by accident. The check
(nagmoe/cuda_rules/placement.py) sees factory calls without `device=` and tensors built from host data; it finds
planted defects of each kind, and the tier's covering set of configs runs clean through forward, backward (with
the activation-checkpoint recompute), the optimizer step and the evaluation."""
import functools

import pytest
import torch

from nagmoe.cuda_rules.placement import ALLOWED, PlacementCheck
from nagmoe.model import build_model
from nagmoe.model.mlp import DenseMLP
from nagmoe.model.moe import MoELayer
from nagmoe.train.trainer import Trainer

from test_trainer_under_rules import COVERING


def _elementwise(x):
    return x + torch.ones(x.shape[-1], dtype=x.dtype)  # an operand made on the host


def _index(x):
    return x[:, torch.arange(x.shape[1])]  # an index made on the host


def _scalar(x):
    return x * torch.tensor(1.0)  # a 0-dim scalar made on the host


def _host_data(x):
    return x * torch.tensor([1.0], device=x.device)  # a pageable host-to-device copy on CUDA


PLANTED = {"elementwise operand": (_elementwise, "ones", "no device"), "index": (_index, "arange", "no device"),
           "0-dim scalar": (_scalar, "tensor", "no device"), "host data": (_host_data, "tensor", "host data")}


@pytest.mark.parametrize("case", list(PLANTED))
@pytest.mark.parametrize("layer_cls", [MoELayer, DenseMLP])
def test_a_planted_defect_in_a_sublayer_is_reported_at_its_line(micro_config, monkeypatch, case, layer_cls):
    plant, function, kind = PLANTED[case]
    original = layer_cls.forward

    @functools.wraps(original)
    def planted(self, x, *args, **kwargs):
        return original(self, plant(x), *args, **kwargs)

    monkeypatch.setattr(layer_cls, "forward", planted)
    cfg = micro_config("model.ffn=dense" if layer_cls is DenseMLP else "model.ffn=moe")
    model = build_model(cfg.model)
    idx = torch.randint(0, cfg.model.vocab_size, (1, 16))
    with PlacementCheck() as check:
        out = model(idx, idx)
        (out.loss + out.aux_loss).backward()
    line = plant.__code__.co_firstlineno + 1
    assert dict(check.findings) == {(f"tests/cuda_rules/test_placement.py:{line}", function, kind): cfg.model.n_layers}, check.report()


def test_the_check_passes_what_is_placed_and_allows_only_named_sites():
    x = torch.ones(3)
    with PlacementCheck() as check:
        torch.zeros(2, device=x.device), torch.full((), 3, device=x.device), torch.zeros_like(x), x.new_zeros(2)
        torch.as_tensor(x, dtype=torch.float64)  # a tensor stays where it is
    assert not check.findings
    with PlacementCheck(allowed={("test_placement.py", "arange"): "the test's own"}) as check:
        torch.arange(3), torch.empty(2)
    assert [k[1] for k in check.findings] == ["empty"]
    for (path, function), why in ALLOWED.items():  # the allow-list stays short and says why
        assert path.startswith("nagmoe/") and why


@pytest.mark.slow
@pytest.mark.parametrize("name,extra", COVERING, ids=[c[0] for c in COVERING])
def test_the_covering_set_creates_every_step_tensor_on_its_device(micro_config, tmp_path, monkeypatch, name, extra):
    """Two optimizer steps and an evaluation of each family under CUDA's rules of torch 2.11 (the GPU machine's):
    the first step builds lazily created state (MoD thresholds, optimizer buffers), the second is steady."""
    monkeypatch.setenv("NAGMOE_CUDA_RULES", "2.11")
    trainer = Trainer(micro_config("train.max_steps=2", "train.eval_tokens=256", *extra), str(tmp_path / name),
                      quiet=True)
    try:
        with PlacementCheck() as check:
            trainer.train_step()
            trainer.train_step()
            trainer.evaluate()
    finally:
        trainer.release_lease()
    assert not check.findings, check.report()
