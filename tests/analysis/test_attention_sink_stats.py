"""BOS-sink statistic: uniform attention gives 1/(t+1) on the first key at query t; the recomputed probabilities
are the module's own (c_proj(p·v) reproduces its output, MHA/GQA and CCA); a model whose queries are zero
attends uniformly, so its per-layer mean is the mean of 1/(t+1) over t >= 1."""
import pytest
import torch

from analysis_models import BOS, SEQ, randomize_outputs, tiny_model, token_batches
from nagmoe.analysis.attention_sink import SinkAccumulator, attention_inputs, first_key_mass, sink_summary
from nagmoe.analysis.run_analysis import analyze_model
from nagmoe.model.attention import causal_attention


def test_uniform_attention_puts_one_over_t_on_the_first_key():
    T = 40
    q = torch.zeros(2, 4, T, 8)  # zero queries: every visible key scores the same
    k = torch.randn(2, 2, T, 8)
    is_bos = torch.zeros(2, T, dtype=torch.bool)
    is_bos[:, [0, 9]] = True
    first, bos = first_key_mass(q, k, is_bos_BL=is_bos)
    t = torch.arange(T, dtype=torch.float32).expand(2, T)
    assert torch.allclose(first, 1.0 / (t + 1))
    n_bos_seen = 1.0 + (t >= 9).float()  # BOS keys at 0 and 9
    assert torch.allclose(bos, n_bos_seen / (t + 1))


def test_only_executed_queries_count_under_mod():
    model = tiny_model("prenorm", "mha")
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.c_q.weight.zero_()  # uniform attention: query t puts 1/(t+1) on key 0
    executed = torch.zeros(2, SEQ, dtype=torch.bool)
    executed[:, [0, 3, 7]] = True  # query 0 never counts
    sink = SinkAccumulator(1)
    sink.add(0, attn, torch.randn(2, SEQ, 32), executed_BT=executed)
    assert sink.count == [4]
    assert sink.report()["first_key_mass_per_layer"] == [pytest.approx((1 / 4 + 1 / 8) / 2)]


def test_a_dominant_first_key_takes_all_the_mass():
    T, S = 12, 8
    k = torch.zeros(1, 1, T, S)
    k[0, 0, 0, 0] = 50.0  # only key 0 scores above 0
    q = torch.zeros(1, 2, T, S)
    q[..., 0] = 1.0
    first, _ = first_key_mass(q, k)
    assert (first > 0.99).all()
    summary = sink_summary([0.6, 0.4, 0.9, None])
    assert summary["layers_above_half"] == 2 and summary["mean_first_key_mass"] == pytest.approx(1.9 / 3)


@pytest.mark.parametrize("attention", ["mha", "cca"])
def test_recomputed_probabilities_reproduce_the_module_output(attention):
    model = tiny_model("prenorm", attention)
    randomize_outputs(model)
    attn = model.blocks[0].attn
    x = torch.randn(3, SEQ, 32)
    q, k, v = attention_inputs(attn, x)
    y = causal_attention(q, k, v, "math")  # the reference score path, fp32 softmax
    B, H, T, S = y.shape
    expected, _ = attn(x)
    assert torch.allclose(attn.c_proj(y.transpose(1, 2).reshape(B, T, H * S)), expected, atol=1e-5)
    first, _ = first_key_mass(q, k)
    probs = torch.softmax((q @ k.repeat_interleave(H // k.shape[1], 1).transpose(-2, -1)) / S ** 0.5
                          + torch.full((T, T), float("-inf")).triu(1), dim=-1)
    assert torch.allclose(first, probs[..., 0].mean(1), atol=1e-6)


@pytest.mark.parametrize("residual", ["nag", "prenorm"])
def test_a_model_with_zero_queries_attends_uniformly(residual):
    model = tiny_model(residual, "mha")
    randomize_outputs(model)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_q.weight.zero_()
    sink = analyze_model(model, token_batches(), bos_id=BOS)["attention_sink"]
    expected = sum(1.0 / (t + 1) for t in range(1, SEQ)) / (SEQ - 1)
    assert sink["first_key_mass_per_layer"] == pytest.approx([expected] * 2, rel=1e-5)
    assert sink["mean_first_key_mass"] == pytest.approx(expected, rel=1e-5)
    assert sink["layers_above_half"] == 0 and sink["n_layers"] == 2
