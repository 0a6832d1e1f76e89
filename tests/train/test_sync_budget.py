"""Issue 26, the sync budget: a training micro-step forces no device-to-host read outside MoD (attention, NAG,
dense path, MoE routing with the grouped backend), one per MoD sublayer (its executed count, padded maximum
and key blocks in one copy), one more per MoE layer under expert parallelism (split sizes); the trainer's
metrics are one copy per optimizer step (plus MoD's calibrator, one). Counted per call site by
nagmoe.train.sync_count on tiny, tiny-mod20 and a reduced-width nag-mod20-r40 (26 MoD sublayers)."""
import os
import tempfile

import pytest

from nagmoe.config import load_config
from nagmoe.train.sync_count import SyncCounter, budget, count_micro_step, mod_sublayers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_NOW = ("model.mod.start_tokens=0", "model.nag.warmup_tokens=0")
REDUCED_R40 = ("model.d_model=128", "model.attention.n_heads=4", "model.moe.expert_hidden=64",
               "model.vocab_size=512", "data.seq_len=128")
CONFIGS = {
    "tiny": ("configs/tiny.yaml", ()),
    "tiny-mod20": ("configs/tiny-mod20.yaml", ()),
    "reduced-nag-mod20-r40": ("configs/paper/nag-mod20-r40.yaml", REDUCED_R40),
    "reduced-baseline-r40": ("configs/paper/baseline-r40.yaml", REDUCED_R40),
}


def sites_outside(counter, path):
    return {site: n for site, n in counter.counts.items() if not site.startswith(path)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_micro_step_keeps_the_sync_budget(name):
    path, overrides = CONFIGS[name]
    cfg = load_config(os.path.join(REPO, path), [*overrides, *START_NOW])
    counter, model = count_micro_step(cfg, dtype="bf16", batch_rows=2)
    assert model.blocks[0].ffn.backend == "grouped"
    skipping = mod_sublayers(model)
    if "mod" in name:  # the counted step really skips, on every eligible sublayer
        assert skipping == 2 * cfg.model.n_layers and bool(model.mod_calibrator().skipping.all())
    assert sites_outside(counter, "nagmoe/model/mod.py") == {}, counter.table()
    assert counter.total <= budget(model) == skipping, counter.table()


def test_the_loop_backend_reads_its_group_sizes_once_per_moe_layer():
    cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"), ["model.moe.impl=loop"])
    counter, model = count_micro_step(cfg, dtype="fp32")
    assert set(counter.counts) == {s for s in counter.counts if "grouped_experts.py" in s}
    assert counter.total == cfg.model.n_layers, counter.table()


def test_the_trainer_reads_its_metrics_once_per_optimizer_step(micro_config):
    from nagmoe.train.trainer import Trainer

    cfg = micro_config("model.mod.skip_rate=0.2", *START_NOW, "train.micro_batch_tokens=128")
    trainer = Trainer(cfg, tempfile.mkdtemp(), quiet=True)
    for _ in range(2):
        trainer.train_step()
    with SyncCounter() as counter:
        rec = trainer.train_step()
    assert trainer.accum == 2 and rec["moe_max_over_mean"] >= 1.0 and rec["mod_skipping"]
    per_file = counter.by_file()
    assert per_file.pop("nagmoe/train/trainer.py") == 1, counter.table()  # loss, aux, grad norm, expert load
    assert per_file.pop("nagmoe/model/mod_calibration.py") == 1, counter.table()  # the calibrator's update
    assert per_file.pop("nagmoe/model/mod.py") <= trainer.accum * mod_sublayers(trainer.model), counter.table()
    assert per_file == {}, counter.table()


def test_the_counter_sees_every_kind_of_read():
    import torch

    x = torch.arange(6.0)
    with SyncCounter() as counter:
        x.tolist(), x[0].item(), float(x[1]), bool(x[2] > 0), x.cpu(), x.numpy()
        torch.bincount(x.long()), x.nonzero(), x[x > 2], x.masked_select(x > 1), torch.unique(x)
        x.repeat_interleave(torch.tensor([1, 0, 2, 0, 0, 1]))
        x.repeat_interleave(torch.tensor([1, 0, 2, 0, 0, 1]), output_size=4)  # size given: no read
        torch.nonzero_static(x > 2, size=3)
    ops = sorted(site.split(" ")[1] for site in counter.counts)
    assert ops == sorted(["tolist", "item", "__float__", "__bool__", "cpu", "numpy", "bincount", "nonzero", "index",
                          "masked_select", "_unique2", "repeat_interleave"]), counter.table()
    assert all(site.startswith("test_sync_budget.py:") for site in counter.counts)  # the caller, not torch


def test_a_blocking_host_copy_to_a_device_is_counted():
    """Issue 39: `to(device)` from pageable host memory waits for the stream; only a pinned, non-blocking copy
    does not (nagmoe/data/host_copy.py, checked on CUDA in tests/gpu). Here "meta" stands for the device."""
    import torch

    x = torch.arange(6.0)
    with SyncCounter() as counter:
        x.to("meta"), x.to(device="meta", non_blocking=True), x.to(torch.device("meta"), torch.float16)
        x.to("cpu"), x.to(torch.float64)  # host to host: no copy to wait for
    assert [site.split(" ")[1] for site in counter.counts] == ["to-device"] and counter.total == 3, counter.table()


def test_the_trainers_batch_copy_is_plain_off_cuda():
    import torch

    from nagmoe.data.host_copy import to_device

    x = torch.arange(6)
    with SyncCounter() as counter:
        y = to_device(x, torch.device("cpu"))
    assert y is x and counter.total == 0  # pin_memory() would raise on a CPU-only torch
