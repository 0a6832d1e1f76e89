"""The HF model computes what nagmoe computes (issue 42, "Parity" and "Complete"), for every variant of the matrix:
log-probabilities over all positions and the whole vocabulary, expert choices and MoD executed masks."""
import pytest
import torch

import hf_variants as V
from nagmoe.hf.export import PREFIX, native_outputs

MAX_LOGP, MAX_KL, GAP = 1e-4, 1e-9, 1e-5


def parity(native: dict, hf: dict) -> dict:
    lp_n, lp_h = native["logits"].double().log_softmax(-1), hf["logits"].double().log_softmax(-1)
    top2 = native["logits"].topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > GAP
    return {"max_dlogp": float((lp_n - lp_h).abs().max()),
            "kl": float((lp_n.exp() * (lp_n - lp_h)).sum(-1).mean()),
            "argmax_differs": int(((lp_n.argmax(-1) != lp_h.argmax(-1)) & decided).sum()),
            "excluded": int((~decided).sum())}


def same_decisions(native: dict, hf: dict) -> list:
    """Sublayers whose MoD mask or expert choices (on the tokens nagmoe routed) differ."""
    bad = [k for k in native if k.startswith("mask.") and not torch.equal(native[k], hf.get(k, torch.empty(0)))]
    bad += [k for k in hf if k.startswith("mask.") and k not in native]
    for key in (k for k in native if k.startswith("choices.")):
        mask = hf.get("mask." + key.split(".")[1])
        got = hf[key] if mask is None else hf[key][mask.reshape(-1)]
        if not torch.equal(native[key], got):
            bad.append(key)
    return bad


@pytest.mark.parametrize("name", list(V.VARIANTS))
def test_fp32_parity(name, native_of):
    cfg, model = native_of(name)
    ids = V.test_batch()
    native = native_outputs(model, ids)
    hf = V.hf_outputs(V.hf_model(cfg, model), ids)
    p = parity(native, hf)
    print(name, p)
    assert p["max_dlogp"] <= MAX_LOGP and p["kl"] <= MAX_KL and p["argmax_differs"] == 0, p
    assert p["excluded"] < ids.numel() // 10, p  # the argmax check decides almost everywhere
    assert same_decisions(native, hf) == []
    if model.mod_calibrator() is not None:  # the masks are real decisions: some tokens skip, some execute
        masks = [v for k, v in hf.items() if k.startswith("mask.")]
        assert masks and any(0 < int(m.sum()) < m.numel() for m in masks)


@pytest.mark.parametrize("name", ["nag-cca-moe32top4-mod20", "prenorm-mha-moe"])
def test_bf16_export_against_native_fp32(name, native_of):
    cfg, model = native_of(name)
    ids = V.test_batch(rows=4)
    native = native_outputs(model, ids)
    hf_model = V.hf_model(cfg, model, torch.bfloat16)
    assert hf_model.model.blocks[0].attn.c_q.weight.dtype == torch.bfloat16  # really cast
    hf = V.hf_outputs(hf_model, ids)
    lp_n, lp_h = native["logits"].log_softmax(-1), hf["logits"].log_softmax(-1)
    top1 = float((lp_n.argmax(-1) == lp_h.argmax(-1)).float().mean())
    kl = float((lp_n.exp() * (lp_n - lp_h)).sum(-1).mean())
    print(name, "bf16 top-1", top1, "KL", kl)
    assert top1 >= 0.99 and kl <= 1e-3


@pytest.mark.parametrize("name", ["nag-cca-moe32top4-mod20", "prenorm-cca-dense"])
def test_exported_keys_are_the_native_persistent_keys(name, native_of):
    cfg, model = native_of(name)
    hf = V.hf_model(cfg, model)
    assert set(hf.state_dict()) == {PREFIX + k for k in model.state_dict()}
    assert {k: v.dtype for k, v in hf.state_dict().items()} == {PREFIX + k: v.dtype for k, v in model.state_dict().items()}
