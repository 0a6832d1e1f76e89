"""The issue-42 matrix of tiny models, built in-process with every parameter redrawn (so zero-initialised output
projections hide no sublayer) and MoD calibrated to a realised skip of 0.15-0.25 on the test batch.

{pre-norm, NAG} x {MHA, CCA} x {dense, MoE top-2}, plus NAG + MoD (MoE FFN, 20% skip) for both attention
kinds, the CCA one with 32 experts top-4: 10 variants."""
from __future__ import annotations

import os

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB, SEQ = 300, 48
BASE = ["model.vocab_size=300", "model.d_model=32", "model.n_layers=2", "model.max_seq_len=64",
        "model.attention.n_heads=4", "model.attention.q_compression=2", "model.attention.kv_compression=2",
        "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=16", "model.nag.C=4",
        "model.nag.warmup_tokens=0", "data.seq_len=48", "train.batch_tokens=192"]
MOD = ["model.residual=nag", "model.ffn=moe", "model.mod.skip_rate=0.2", "model.mod.start_tokens=0"]


def _grid():
    out = {}
    for residual in ("prenorm", "nag"):
        for kind in ("mha", "cca"):
            for ffn in ("dense", "moe"):
                out[f"{residual}-{kind}-{ffn}"] = [f"model.residual={residual}", f"model.attention.kind={kind}",
                                                   f"model.ffn={ffn}"]
    out["nag-mha-moe-mod20"] = [*MOD, "model.attention.kind=mha"]
    out["nag-cca-moe32top4-mod20"] = [*MOD, "model.attention.kind=cca", "model.moe.n_experts=32",
                                      "model.moe.top_k=4", "model.nag.C=32"]
    # the loss-free expert bias (issue 43) rides along: the export carries it on the selection key
    out["prenorm-mha-moe-bias"] = ["model.residual=prenorm", "model.attention.kind=mha", "model.ffn=moe",
                                   "model.moe.expert_bias=true"]
    return out


VARIANTS = _grid()
MOD_VARIANTS = [name for name in VARIANTS if "mod20" in name]


def config(name: str, *extra: str):
    from nagmoe.config import load_config

    return load_config(os.path.join(REPO, "configs/tiny.yaml"), [*BASE, *VARIANTS[name], *extra])


def test_batch(seed: int = 1, rows: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
    ids[:, 0] = 0
    return ids


@torch.no_grad()
def redraw(model, seed: int = 0) -> None:
    """Every parameter from N(0, s): s = fan_in^-0.5 for matrices (fan_in = the last-but-one dim for the expert
    stacks), 0.5 for everything else (gates, biases, temperatures, convolutions); NAG's encode gain 3."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2 and not name.endswith(("conv_seq.weight", "conv_head.weight")):
            fan_in = p.shape[-2] if name.endswith(("w_in", "w_out")) else p.shape[-1]
            std = fan_in ** -0.5
        else:
            std = 0.5
        p.copy_(torch.randn(p.shape, generator=g) * std)
    for name, b in model.named_buffers():  # an expert bias that really reroutes (probabilities ~1/E)
        if name.endswith("expert_bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    if hasattr(model.stream, "g_encode"):  # NAG logits = exp(s)·cos: a stream norm of ~e^3 gives logits of a few
        model.stream.g_encode.fill_(3.0)   # units, so the distribution is far from uniform (parity not vacuous)


def calibrate_mod(model, batch: torch.Tensor, steps: int = 20) -> float:
    """Training-mode forwards + mod_update fill the score histograms (as training does), then the compute dial
    (nagmoe.analysis.compute_dial) sets thresholds realising 20% on `batch`; returns the realised skip rate
    (work weighted) of an eval forward on `batch`."""
    from nagmoe.analysis.compute_dial import calibrate_skip_rate

    mod = model.mod_calibrator()
    g = torch.Generator().manual_seed(7)
    model.train()
    with torch.no_grad():
        for _ in range(steps):
            model(torch.randint(1, VOCAB, (4, SEQ), generator=g))
            model.mod_update()
    model.eval()
    with torch.no_grad():
        calibrate_skip_rate(model, 0.2, lambda: model(batch))
        mod.reset_inference_counts()
        model(batch)
    return mod.inference_skip_rate()


def native_model(name: str):
    """(config, eval-mode fp32 native model) of variant `name`, redrawn and, for MoD, calibrated."""
    from nagmoe.model import build_model

    cfg = config(name)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.set_mod_seq_len(cfg.data.seq_len)
    redraw(model)
    if model.mod_calibrator() is not None:
        rate = calibrate_mod(model, test_batch())
        assert 0.15 <= rate <= 0.25, f"{name}: MoD realised skip {rate:.3f} outside 0.15-0.25 before comparing"
    return cfg, model.eval()


def hf_model(cfg, model, dtype: torch.dtype = torch.float32):
    """The in-process HF model of a native one through the exporter's own mapping (identity keys, role cast)."""
    from nagmoe.hf.remote.configuration_nagmoe import NagMoeConfig
    from nagmoe.hf.remote.modeling_nagmoe import NagMoeForCausalLM
    from nagmoe.hf.export import export_state, layout_of
    from nagmoe.config.schema import to_dict

    hf = NagMoeForCausalLM(NagMoeConfig(nagmoe_model=to_dict(cfg.model), layout=layout_of(model),
                                        seq_len=cfg.data.seq_len, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    hf.load_state_dict(export_state(model, torch.float32), strict=True)
    if dtype != torch.float32:
        state = export_state(model, dtype)
        for key, t in state.items():
            if t.dtype == dtype:
                hf.get_parameter(key).data = t.clone()
    return hf.eval()


@torch.no_grad()
def hf_outputs(hf, ids_BT: torch.Tensor) -> dict:
    """The HF model's logits, expert choices (all tokens) and MoD masks, keyed as nagmoe.hf.export.native_outputs."""
    out = {"logits": hf(ids_BT, use_cache=False).logits.float()}
    for i, block in enumerate(hf.model.blocks):
        if getattr(block.ffn, "last_choices", None) is not None:
            out[f"choices.{2 * i + 1}"] = block.ffn.last_choices
    mod = getattr(hf.model.stream, "mod", None)
    if mod is not None:
        out.update({f"mask.{k}": v for k, v in mod.last_masks.items() if v is not None})
    return out
