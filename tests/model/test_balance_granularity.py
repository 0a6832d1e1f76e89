"""Balance-loss granularity (issue 43 item 2): `sequence` is today's formula per row, averaged over rows — equal
to a hand loop over the rows, with and without MoD (whose executed tokens reach the MoE as one flat row)."""
import pytest
import torch

from nagmoe.config import MoEConfig
from nagmoe.model.moe import MoELayer, load_balancing_loss

D, E, K = 16, 6, 2


def layer(granularity):
    torch.manual_seed(0)
    return MoELayer(D, MoEConfig(n_experts=E, top_k=K, expert_hidden=8, impl="loop", lb_granularity=granularity))


def hand_loop(m, x_ND, row_N):
    """Today's micro-batch LB on each row's tokens alone, averaged over the rows that have tokens."""
    probs = torch.softmax(m.router(x_ND), -1)
    chosen = probs.topk(K, -1).indices
    values = []
    for b in sorted(set(row_N.tolist())):
        sel = row_N == b
        counts = torch.bincount(chosen[sel].reshape(-1), minlength=E)
        values.append(load_balancing_loss(probs[sel], counts, K))
    return torch.stack(values).mean()


def test_sequence_equals_a_hand_loop_over_four_rows():
    m = layer("sequence")
    x = torch.randn(4, 9, D)
    m(x)
    want = hand_loop(m, x.reshape(-1, D), torch.arange(4).repeat_interleave(9))
    assert torch.allclose(m.last_stats["lb_loss"], want, atol=1e-6, rtol=0)
    micro = layer("micro_batch")
    micro(x)
    assert not torch.allclose(micro.last_stats["lb_loss"], want)  # a different statistic on this batch


def test_sequence_on_mods_flat_gather_uses_each_tokens_row():
    """Rows of different lengths, one row with no executed token (left out of the mean)."""
    m = layer("sequence")
    row_N = torch.tensor([0, 0, 0, 2, 2, 3, 3, 3, 3, 3])  # row 1 executed nothing
    x_1ND = torch.randn(1, len(row_N), D)
    m(x_1ND, rows=(row_N, 4))
    want = hand_loop(m, x_1ND[0], row_N)
    assert torch.allclose(m.last_stats["lb_loss"], want, atol=1e-6, rtol=0)
    m(x_1ND)  # without the rows: one row of 10 tokens, the micro-batch statistic
    assert torch.allclose(m.last_stats["lb_loss"], hand_loop(m, x_1ND[0], torch.zeros(10, dtype=torch.long)),
                          atol=1e-6, rtol=0)


def test_a_mod_model_hands_the_moe_its_rows():
    from nagmoe.config import load_config
    from nagmoe.model import build_model
    from nagmoe.model.mod import ExecutedTokens

    cfg = load_config(None, ["model.ffn=moe", "model.mod.skip_rate=0.3", "model.mod.start_tokens=0",
                             "model.nag.warmup_tokens=0", "model.moe.lb_granularity=sequence", "model.d_model=32",
                             "model.n_layers=2", "model.vocab_size=300", "model.max_seq_len=32", "data.seq_len=32",
                             "train.batch_tokens=128"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randint(0, 300, (4, 32)))
            model.mod_update()
    seen = []
    ffn = model.blocks[1].ffn
    ffn.register_forward_hook(lambda mod, args, kwargs, out: seen.append(kwargs.get("rows")), with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(0, 300, (4, 32)))
    assert seen and seen[0] is not None and seen[0][1] == 4  # the gathered tokens came with their rows
    row_N = seen[0][0]
    assert row_N.shape[0] < 4 * 32 and bool((row_N[1:] >= row_N[:-1]).all())  # executed only, row-major
    assert ExecutedTokens is not None


def test_granularity_is_validated():
    from nagmoe.config import load_config
    from nagmoe.base.errors import UserError

    with pytest.raises(UserError, match="lb_granularity"):
        load_config(None, ["model.moe.lb_granularity=global"])
