"""Accounting: analytic counts against built models and against torch's FLOP counter on reference paths."""
import glob
import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nagmoe.config import load_config
from nagmoe.flops import flops_per_token, mod_token_ratio, param_counts, peak_flops

TINY_OVERRIDES = ["model.d_model=64", "model.n_layers=2", "model.vocab_size=256", "model.attention.n_heads=4",
                  "model.moe.expert_hidden=96", "model.max_seq_len=64", "data.seq_len=64",
                  "train.batch_tokens=128"]
VARIANTS = [(res, ffn) for res in ("prenorm", "nag") for ffn in ("dense", "moe")]


def tiny_cfg(repo_root, residual, ffn, extra=()):
    return load_config(os.path.join(repo_root, "configs/tiny.yaml"),
                       [*TINY_OVERRIDES, f"model.residual={residual}", f"model.ffn={ffn}", *extra])


@pytest.mark.parametrize("residual, ffn", VARIANTS)
def test_param_counts_equal_numel(repo_root, residual, ffn):
    from nagmoe.model import build_model

    cfg = tiny_cfg(repo_root, residual, ffn)
    model = build_model(cfg.model)
    counts = param_counts(cfg.model)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["total"] == counts["active"] + counts["experts"] - counts["experts_active"]


@pytest.mark.parametrize("residual, ffn", VARIANTS)
def test_flops_match_torch_counter_on_reference_paths(repo_root, residual, ffn):
    """Per-expert loop and explicit-matmul attention, so the counter sees every FLOP; 3 batches of routing."""
    from nagmoe.model import build_model

    cfg = tiny_cfg(repo_root, residual, ffn, ["model.attention.impl=math", "model.moe.impl=loop"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    B, T = 2, cfg.data.seq_len
    idx = torch.randint(0, cfg.model.vocab_size, (B, T))
    with FlopCounterMode(display=False) as counter:
        out = model(idx, idx)
        (out.loss + out.aux_loss).backward()
    measured = counter.get_total_flops() / (B * T)
    expected = flops_per_token(cfg.model, T)
    assert measured == pytest.approx(expected, rel=0.05), (measured, expected)


def test_mod_executed_fraction_lowers_flops_and_gives_token_ratio(repo_root):
    cfg = tiny_cfg(repo_root, "nag", "moe")
    T = cfg.data.seq_len
    full = flops_per_token(cfg.model, T)
    part = flops_per_token(cfg.model, T, 0.8)
    assert part < full
    ratio = mod_token_ratio(cfg.model, T, 0.8)
    assert 1.0 < ratio < 1.25  # K/V, modulators and the unembedding are paid for skipped tokens
    per_sublayer = [1.0, 0.8] * cfg.model.n_layers
    assert full > flops_per_token(cfg.model, T, per_sublayer) > part


PAPER = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs/paper/*-r*.yaml")))


@pytest.mark.parametrize("path", PAPER, ids=[os.path.basename(p) for p in PAPER])
def test_paper_configs_build_on_meta_and_hit_targets(path):
    from nagmoe.model import build_model

    cfg = load_config(path)
    assert cfg.model.vocab_size == 32768 and cfg.data.seq_len == 2048
    assert cfg.model.residual != "nag" or cfg.model.nag.C >= cfg.model.moe.n_experts
    counts = param_counts(cfg.model)
    assert counts["total"] == pytest.approx(900e6, rel=0.05)
    assert counts["active"] == pytest.approx(150e6, rel=0.05)
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == counts["total"]


def test_paper_ratios_present():
    names = {os.path.basename(p) for p in PAPER}
    for r in (20, 40, 80):
        assert {f"nag-r{r}.yaml", f"baseline-r{r}.yaml"} <= names


def test_solver_hits_targets(repo_root):
    from nagmoe.layout_solver import solve_layout

    cfg = load_config(os.path.join(repo_root, "configs/paper/base.yaml"))
    lay = solve_layout(cfg.model, 900e6, 150e6, 40)
    assert lay.error < 0.05 and abs(lay.ratio / 40 - 1) < 0.1
    assert lay.model.d_model % lay.model.attention.n_heads == 0
    assert lay.model.nag.C >= lay.model.moe.n_experts


def test_peak_flops_unknown_hardware_is_none():
    assert peak_flops("cpu") is None
    assert peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989e12)
