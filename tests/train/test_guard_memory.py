"""Neither guard decodes the whole vocabulary (issue 38). The gate-collapse check ran a forward with statistics and
no targets, which decoded full (B, T, V) logits: 16 x 2048 x 32768 (2 GiB bf16 + 4 GiB fp32) every 100 steps at
the paper's micro-batch. Both guards (the gate-collapse gains and the non-finite locator, forward and backward) are
run with every op's output shape recorded: no tensor whose last dimension is the vocabulary has more rows than
one loss chunk."""
import os

import pytest
import torch

from nagmoe.config import load_config
from nagmoe.cuda_rules.contracts import LargestRows
from nagmoe.model import build_model
from nagmoe.train.guards import locate_nonfinite, realised_gains

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
V, D, CHUNK = 509, 16, 16  # no other dimension is 509; the (D, V) transposed head has D = CHUNK rows
B, T = 2, 32


def _model(residual):
    cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"), [
        f"model.residual={residual}", f"model.vocab_size={V}", f"model.d_model={D}", "model.n_layers=2",
        "model.attention.n_heads=2", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=16",
        "model.nag.C=4", f"data.seq_len={T}", f"model.max_seq_len={T}"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.loss_chunk_tokens = CHUNK  # B·T = 64 tokens: four chunks
    return model


@pytest.mark.parametrize("residual", ["nag", "prenorm"])
def test_guards_stay_within_one_loss_chunk(residual):
    model = _model(residual)
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    with LargestRows(V) as gains_rows:
        gains = realised_gains(model, x)
    with LargestRows(V) as locate_rows:
        where = locate_nonfinite(model, x, y)
    assert (gains is not None) == (residual == "nag") and (gains is None or len(gains) == 4)
    assert "not reproduced" in where  # finite model: forward and backward both ran
    assert gains_rows.rows <= CHUNK and locate_rows.rows <= CHUNK, (gains_rows.rows, locate_rows.rows)


def test_gains_without_decoding_equal_the_decoding_forward():
    model = _model("nag").eval()
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x, collect_stats=True).stats["gain_mean"]
    assert realised_gains(model, x) == list(full)
