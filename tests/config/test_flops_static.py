"""Issue 69, honest accounting: `model.mod.impl: static` computes every row's attention (scores for every query, the
o projection, MHA's q), routes every token and runs a dense FFN on every row; only the MoE's expert GEMMs skip. Its
executed FLOPs charge that; the charged training FLOPs (the budget) stay those of the executed fractions. The
expected terms below come from the config's widths, not from nagmoe/config/flops.py."""
import os

import pytest

from nagmoe.config import load_config
from nagmoe.flops import executed_flops_per_token, flops_per_token, static_computed_flops_per_token

T, D, L, HEADS, E, K, H = 64, 64, 2, 4, 8, 2, 96
EXECUTED = [0.9, 0.7, 0.6, 0.8]  # attention and FFN of block 0, then of block 1
PADDED = [0.95, 0.7, 0.75, 0.8]  # gather's padded query rows (attention entries only matter)


def config(repo_root, kind, ffn):
    return load_config(os.path.join(repo_root, "configs/tiny.yaml"), [
        f"model.d_model={D}", f"model.n_layers={L}", "model.vocab_size=256", f"model.attention.n_heads={HEADS}",
        f"model.attention.kind={kind}", "model.attention.q_compression=2", "model.attention.kv_compression=2",
        f"model.ffn={ffn}", f"model.moe.n_experts={E}", f"model.moe.top_k={K}", f"model.moe.expert_hidden={H}",
        f"model.max_seq_len={T}", f"data.seq_len={T}", "train.batch_tokens=128", "model.mod.skip_rate=0.2"]).model


def skipped_but_computed(kind, ffn):
    """Forward FLOPs per skipped token that static still computes, per attention and per FFN sublayer: 2 FLOPs a
    multiply-add; the query side is the latent (CCA: 4 reference heads of 16 compressed 2x -> 2 heads, 32 wide)."""
    latent = D // 2 if kind == "cca" else D
    scores = 2 * 2 * latent * T  # QK^T and AV over the full T x T
    c_proj = 2 * latent * D
    c_q = 2 * D * latent if kind == "mha" else 0  # CCA's q runs for every token under gather too (its convs)
    ffn_kept = 2 * D * E if ffn == "moe" else 2 * 2 * D * 4 * D  # the router; a dense FFN whole (hidden 4d)
    return scores + c_proj + c_q, ffn_kept


@pytest.mark.parametrize("kind, ffn", [("cca", "moe"), ("mha", "moe"), ("cca", "dense"), ("mha", "dense")])
def test_static_charges_the_skipped_rows_it_computes(repo_root, kind, ffn):
    m = config(repo_root, kind, ffn)
    att, ffn_kept = skipped_but_computed(kind, ffn)
    want = 3 * sum((1 - EXECUTED[2 * i]) * att + (1 - EXECUTED[2 * i + 1]) * ffn_kept for i in range(L))
    gather = executed_flops_per_token(m, T, EXECUTED, EXECUTED, impl="gather")  # no padding: gather = charged
    static = executed_flops_per_token(m, T, EXECUTED, EXECUTED, impl="static")
    assert static - gather == pytest.approx(want, rel=1e-12)
    # the budget does not move: the charged FLOPs are the executed fractions', whatever ran
    assert gather == pytest.approx(flops_per_token(m, T, EXECUTED), rel=1e-12)
    # static computes every query row: gather's padding is not its cost
    assert executed_flops_per_token(m, T, EXECUTED, PADDED, impl="static") == static
    padding = 3 * sum(2 * 2 * (D // 2 if kind == "cca" else D) * T * (PADDED[2 * i] - EXECUTED[2 * i])
                      for i in range(L))
    assert executed_flops_per_token(m, T, EXECUTED, PADDED, impl="gather") - gather == pytest.approx(padding)
    parts = static_computed_flops_per_token(m, T, EXECUTED)
    assert sum(parts.values()) * 3 == pytest.approx(want, rel=1e-12)
    assert set(parts) == {"attention_scores", "attention_proj", "router"} | ({"ffn"} if ffn == "dense" else set())


@pytest.mark.parametrize("kind", ["cca", "mha"])
def test_static_saves_exactly_the_expert_gemms(repo_root, kind):
    """From the other side: static's executed FLOPs are full depth less the skipped slots' expert GEMMs (top-k
    experts of two d x H matmuls each); with a dense FFN it saves nothing."""
    m = config(repo_root, kind, "moe")
    experts = 2 * K * 2 * D * H
    want = flops_per_token(m, T) - 3 * sum((1 - EXECUTED[2 * i + 1]) * experts for i in range(L))
    assert executed_flops_per_token(m, T, EXECUTED, EXECUTED, impl="static") == pytest.approx(want, rel=1e-12)
    dense = config(repo_root, kind, "dense")
    assert executed_flops_per_token(dense, T, EXECUTED, EXECUTED, impl="static") == pytest.approx(
        flops_per_token(dense, T), rel=1e-12)
    non_embedding = executed_flops_per_token(m, T, EXECUTED, EXECUTED, "non_embedding", impl="static")
    assert want - non_embedding == pytest.approx(3 * 2 * D * 256, rel=1e-12)  # only the unembedding differs


def test_an_unknown_impl_is_refused(repo_root):
    m = config(repo_root, "cca", "moe")
    with pytest.raises(ValueError, match="auto"):
        executed_flops_per_token(m, T, EXECUTED, EXECUTED, impl="auto")  # resolved per device before pricing
