"""Mixture-of-Depths from the NAG geometry (nagmoe/model/mod.py): layouts, attention on executed queries,
the all-executed and skipped-token updates, gradients, causality, the calibrator, and real FLOPs."""
import functools

import numpy as np
import pytest
import torch

from nagmoe.config import MoDConfig
from nagmoe.base.errors import UserError
from nagmoe.flops import flops_per_token
from nagmoe.model import build_model
from nagmoe.model.attention import attention_at_positions, causal_attention
from nagmoe.model.mod_calibration import EXECUTE_ALL, MoDCalibrator, histogram_quantile
from nagmoe.model.mod import ExecutedTokens, eligible_sublayers, run_on_executed
from nagmoe.model.nag import nag_update
from nagmoe.model.residual import NAGState
from flop_counter import flop_counter  # FlopCounterMode with the corrected grouped-conv backward (decisions.md)
from tiny_models import randomize_output_projections, tiny_config

V = 64
ATTENTIONS = {
    "mha": dict(kind="mha", n_kv_heads=None),
    "gqa": dict(kind="mha", n_kv_heads=2, rope_fraction=0.5),
    "cca": dict(kind="cca", q_compression=2, kv_compression=2),
    "ccgqa": dict(kind="cca", q_compression=1, kv_compression=4, conv_kernel_1=3, conv_kernel_2=3),
}


THRESHOLD_MODES = {"global": {}, "per_sublayer": {}, "fixed": {"p_thres": 0.5}}


def mod_model(attention="cca", impl="sdpa", ffn="dense", skip_rate=0.3, seed=0, sublayers="all", threshold="global"):
    torch.manual_seed(seed)
    # a nonzero X_l (the legacy init; the default starts it at zero) so that skipped tokens move too
    cfg = tiny_config("nag", impl, attention=dict(ATTENTIONS[attention]), ffn=ffn,
                      mod=MoDConfig(skip_rate=skip_rate, sublayers=sublayers, base_init_std=0.02, threshold=threshold,
                                    **THRESHOLD_MODES[threshold]))
    if ffn == "moe":
        cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.expert_hidden = 4, 2, 32
    model = build_model(cfg)
    randomize_output_projections(model, seed)  # every sublayer moves the stream
    return model


def _idx(B=2, T=24, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def calibrate(model, idx):
    """One training forward to fill the histograms, then the update that sets thresholds and starts."""
    model.train()
    with torch.no_grad():
        model(idx)
    model.mod_update()
    assert bool(model.stream.mod.skipping.all())
    return model


class DecisionSpy:
    """Wraps the real calibrator's `select` and keeps (sublayer, scores, mask) of every call."""

    def __init__(self, calibrator):
        self.calls = []
        real = calibrator.select

        def select(index, score_BT):
            out = real(index, score_BT)
            mask = torch.ones_like(score_BT, dtype=torch.bool) if out is None else out.mask_BT
            self.calls.append((index, score_BT.detach().clone(), mask.clone()))
            return out

        calibrator.select = select


# ----------------------------------------------------------------------------------------------------------
# Layouts and attention
# ----------------------------------------------------------------------------------------------------------
def test_executed_tokens_layouts_round_trip():
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    sel = ExecutedTokens(mask)
    x = torch.arange(3 * 5 * 2, dtype=torch.float32).view(3, 5, 2)
    x_N = sel.gather(x)
    assert sel.n == 4 and x_N.shape == (4, 2)
    torch.testing.assert_close(sel.scatter(x_N), x * mask[..., None])
    positions, valid = sel.padded()
    assert positions.shape == (3, 3)
    assert positions.tolist() == [[0, 2, 3], [3, 0, 0], [0, 0, 0]]  # padding slots at position 0
    assert valid.tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    padded = sel.to_padded(x_N)
    assert padded[1, 1:].abs().sum() == 0 and padded[2].abs().sum() == 0
    torch.testing.assert_close(sel.from_padded(padded), x_N)
    # one-copy layouts: straight into the padded layout; base plus the executed rows in one pass
    assert torch.equal(sel.from_padded(sel.gather_padded(x)), x_N)
    assert torch.equal(sel.gather_padded(x)[valid], padded[valid])


@pytest.mark.parametrize("B, T", [(3, 5), (1, 1), (2, 1)])  # (1, 1): one decoded token, the output is 1 row
def test_one_pass_layouts_equal_the_two_pass_ones_with_their_gradients(B, T):
    gen = torch.Generator().manual_seed(B * 10 + T)
    mask = torch.rand(B, T, generator=gen) > 0.4
    mask.view(-1)[0] = True
    sel = ExecutedTokens(mask)
    base = torch.randn(4, generator=gen, requires_grad=True)
    y = torch.randn(sel.n, 4, generator=gen, requires_grad=True)
    x = torch.randn(B, T, 4, generator=gen, requires_grad=True)
    probe = torch.randn(B, T, 4, generator=gen)
    fused = sel.scatter_onto(base, y)
    reference = sel.scatter(y) + base
    assert torch.equal(fused, reference)  # bit for bit: X_l + F executed, X_l skipped
    grads = [torch.autograd.grad((out * probe).sum(), (base, y)) for out in (fused, reference)]
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)
    g_N = y[:, 0].detach()  # the MoE's gate scale S / sg(S): 1 for skipped tokens, its value for executed ones
    scale = sel.scatter_onto(g_N.new_ones(()), g_N - 1.0)
    assert torch.equal(scale, 1.0 + sel.scatter((g_N - 1.0).unsqueeze(-1)).squeeze(-1))
    assert scale.shape == (B, T) and bool((scale[~mask] == 1).all())
    _, valid = sel.padded()
    one, two = sel.gather_padded(x), sel.to_padded(sel.gather(x))
    assert torch.equal(one[valid], two[valid])
    q_probe = torch.randn(sel.n, 4, generator=gen)  # only executed rows leave the padded layout
    g_one, = torch.autograd.grad((sel.from_padded(one) * q_probe).sum(), x)
    g_two, = torch.autograd.grad((sel.from_padded(two) * q_probe).sum(), x)
    assert torch.equal(g_one, g_two)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
@pytest.mark.parametrize("attention", list(ATTENTIONS))
def test_attention_on_executed_queries_equals_rows_of_the_full_attention(attention, impl):
    """Queries at their original positions (explicit mask), keys/values of every token: the executed rows
    of the full causal attention, also for sequences with different counts and after a cached prefix."""
    model = mod_model(attention, impl)
    attn = model.blocks[1].attn
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 16, 32, generator=gen)
    mask = torch.rand(3, 16, generator=gen) > 0.35
    mask[2] = False
    mask[2, 15] = True  # one sequence with a single, last query
    with torch.no_grad():
        full, _ = attn(x)
        part, _ = attn(x, select=ExecutedTokens(mask))
        torch.testing.assert_close(part, full[mask], atol=1e-5, rtol=1e-5)
        cache = model.new_cache(16).layers[0]
        attn(x[:, :6], cache=cache)
        tail, _ = attn(x[:, 6:], cache=cache, select=ExecutedTokens(mask[:, 6:]))
    torch.testing.assert_close(tail, full[:, 6:][mask[:, 6:]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("max_blocks", [1, 3, 16])
def test_blocked_sdpa_at_positions_equals_the_math_reference_and_causal_rows(max_blocks):
    """sdpa runs the ascending queries in blocks against the keys up to each block's last position; the
    result is the math path's and the full causal attention's rows (GQA, sequences with different counts)."""
    gen = torch.Generator().manual_seed(0)
    B, H, K, T, S = 3, 4, 2, 70, 8
    q = torch.randn(B, H, T, S, generator=gen)
    k, v = torch.randn(B, K, T, S, generator=gen), torch.randn(B, K, T, S, generator=gen)
    mask = torch.rand(B, T, generator=gen) > torch.tensor([[0.2], [0.6], [0.9]])
    sel = ExecutedTokens(mask)
    positions, _ = sel.padded()
    q_BMHS = sel.to_padded(sel.gather(q.transpose(1, 2)))
    got = attention_at_positions(q_BMHS.transpose(1, 2), k, v, "sdpa", positions, max_blocks=max_blocks,
                                 min_block=8)
    ref = attention_at_positions(q_BMHS.transpose(1, 2), k, v, "math", positions)
    rows = sel.gather(causal_attention(q, k, v, "math").transpose(1, 2))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sel.from_padded(got.transpose(1, 2)), rows, atol=1e-5, rtol=1e-5)


def test_run_on_executed_gathers_tokens_for_ffn_and_moe():
    model = mod_model(ffn="moe")
    moe = model.blocks[0].ffn
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(1))
    mask = torch.rand(2, 10, generator=torch.Generator().manual_seed(2)) > 0.5
    with torch.no_grad():  # a MoE feeding NAG also returns its gate scale (1 in the forward), per token
        full, _, full_scale = run_on_executed(moe, x)
        part, aux, part_scale = run_on_executed(moe, x, ExecutedTokens(mask))
    torch.testing.assert_close(part, full[mask], atol=1e-6, rtol=1e-6)
    assert full_scale.shape == (2, 10) and part_scale.shape == (int(mask.sum()),)
    assert bool((part_scale == 1).all())
    assert int(moe.last_stats["tokens_per_expert"].sum()) == int(mask.sum()) * 2  # routed only these (top-2)
    empty, _, empty_scale = run_on_executed(moe, x, ExecutedTokens(torch.zeros(2, 10, dtype=torch.bool)))
    assert empty.shape == (0, 32) and empty_scale.shape == (0,)


# ----------------------------------------------------------------------------------------------------------
# The update: all executed, skipped tokens, gradients
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention, impl, ffn", [("cca", "sdpa", "moe"), ("gqa", "math", "dense"),
                                                  ("mha", "sdpa", "dense")])
def test_gather_scatter_with_every_token_executed_equals_the_dense_path(attention, impl, ffn):
    model, idx = mod_model(attention, impl, ffn).eval(), _idx()
    mod = model.stream.mod
    with torch.no_grad():
        dense = model(idx).logits  # before the start: every sublayer runs densely, F + X_l
        mod.skipping.fill_(True)
        mod.threshold.fill_(EXECUTE_ALL)  # the gather/scatter path, with every token above the threshold
        real, selections = mod.select, []
        mod.select = lambda index, score: selections.append(real(index, score)) or selections[-1]
        gathered = model(idx, collect_stats=True)
        del mod.select
    assert len(selections) == 4 and all(s is not None and s.n == idx.numel() for s in selections)
    assert gathered.stats["executed_frac"] == [1.0] * 4
    assert dense.abs().max() > 0.5
    torch.testing.assert_close(gathered.logits, dense, atol=1e-5, rtol=1e-5)
    if ffn == "dense":  # and with X_l = 0 the MoD model is exactly the plain NAG model with the same weights
        plain = build_model(tiny_config("nag", impl, attention=dict(ATTENTIONS[attention]), ffn=ffn)).eval()
        loaded = plain.load_state_dict(model.state_dict(), strict=False)
        assert not loaded.missing_keys
        assert all(".base" in k or k.startswith("stream.mod.") for k in loaded.unexpected_keys)
        with torch.no_grad():
            for gate in model.stream.gates:
                gate.base.zero_()
            torch.testing.assert_close(model(idx).logits, plain(idx).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention, impl, ffn", [("gqa", "math", "dense"), ("cca", "sdpa", "moe")])
@pytest.mark.parametrize("index", [2, 3])  # block 1's attention and FFN
def test_skipped_token_update_is_the_base_vector_update_and_gates_learn_from_it(index, attention, impl, ffn):
    """Every path: MHA/GQA's flat queries and CCA's one-copy padded gather; the dense FFN and the MoE with its
    gate scale scattered onto 1 (nagmoe/model/residual.py)."""
    model = mod_model(attention, impl, ffn)
    if ffn == "moe":  # expert outputs start at zero (w_out zero-init): give F something to say
        with torch.no_grad():
            for block in model.blocks:
                block.ffn.w_out.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(3))
    stream, gate = model.stream, model.stream.gates[index]
    stream.set_injection_warmup(0.7)
    gen = torch.Generator().manual_seed(5)
    direction = torch.randn(2, 12, 32, generator=gen)
    direction = direction / direction.pow(2).mean(-1, keepdim=True).sqrt()
    log_norm = torch.randn(2, 12, generator=gen)
    with torch.no_grad():
        m = gate.modulator(direction)
        from nagmoe.model.nag import rotation_score

        score = rotation_score(gate.alpha, m)
    stream.mod.skipping.fill_(True)
    stream.mod.threshold[index] = float(score.median())
    skipped = score <= stream.mod.threshold[index]
    assert 0 < int(skipped.sum()) < skipped.numel()
    block = model.blocks[index // 2]
    sublayer = block.attn if index % 2 == 0 else functools.partial(run_on_executed, block.ffn)
    stream.train()
    (new_log_norm, new_direction), _ = stream.apply(index, sublayer, NAGState(log_norm, direction))

    # skipped tokens: NAG update with f = X_l only; executed: F(R_bar) + X_l (F's rows of the full batch)
    with torch.no_grad():
        scale = gate.alpha * m * 0.7
        f_full = sublayer(direction)[0]
        ref_skip = nag_update(log_norm, direction, gate.base.expand_as(direction), scale)
        ref_exec = nag_update(log_norm, direction, f_full + gate.base, scale)
    for got, want_skip, want_exec in ((new_log_norm, ref_skip[0], ref_exec[0]),
                                      (new_direction, ref_skip[1], ref_exec[1])):
        torch.testing.assert_close(got[skipped], want_skip[skipped], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[~skipped], want_exec[~skipped], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref_skip[1][~skipped], ref_exec[1][~skipped], atol=1e-3)  # F mattered

    # gradient from the skipped tokens alone reaches alpha, the modulator and X_l, not the sublayer
    probe = torch.randn(32, generator=gen)
    loss = (new_direction[skipped] @ probe).sum() + new_log_norm[skipped].sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    for p in (gate.alpha, gate.weight, gate.bias, gate.beta_raw, gate.base):
        assert p.grad is not None and p.grad.abs().sum() > 0
    sub_module = block.attn if index % 2 == 0 else block.ffn
    for p in sub_module.parameters():
        assert p.grad is None or p.grad.abs().sum() == 0


# ----------------------------------------------------------------------------------------------------------
# Causality and decoding
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threshold", list(THRESHOLD_MODES))
@pytest.mark.parametrize("mod_impl", ["gather", "static"])
def test_skip_decisions_are_causal(threshold, mod_impl):
    model = calibrate(mod_model("ccgqa", "sdpa", "moe", threshold=threshold), _idx(seed=9)).eval()
    model.stream.mod.impl = mod_impl
    idx = _idx(T=24, seed=1)
    changed = idx.clone()
    changed[:, 14:] = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(2))
    runs = []
    for x in (idx, changed):
        spy = DecisionSpy(model.stream.mod)
        with torch.no_grad():
            logits = model(x).logits
        runs.append((spy.calls, logits))
    (a_calls, a_logits), (b_calls, b_logits) = runs
    n_skipped = 0
    for (ia, sa, ma), (ib, sb, mb) in zip(a_calls, b_calls):
        assert ia == ib
        assert torch.equal(ma[:, :14], mb[:, :14])
        torch.testing.assert_close(sa[:, :14], sb[:, :14], atol=1e-6, rtol=0)
        n_skipped += int((~ma).sum())
        assert not torch.equal(ma[:, 14:], mb[:, 14:]) or not torch.allclose(sa[:, 14:], sb[:, 14:])
    assert n_skipped > 0
    torch.testing.assert_close(a_logits[:, :14], b_logits[:, :14], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention, threshold, mod_impl", [
    ("gqa", "global", "gather"), ("cca", "global", "gather"), ("cca", "per_sublayer", "gather"),
    ("cca", "fixed", "gather"), ("gqa", "global", "static"), ("cca", "global", "static")])
def test_cached_decoding_makes_the_full_forwards_decisions(attention, threshold, mod_impl):
    model = calibrate(mod_model(attention, "sdpa", "moe", threshold=threshold), _idx(seed=4)).eval()
    model.stream.mod.impl = mod_impl
    idx = _idx(B=1, T=20, seed=6)
    spy = DecisionSpy(model.stream.mod)
    with torch.no_grad():
        full = model(idx).logits
        full_calls, spy.calls = spy.calls, []
        cache = model.new_cache(20)
        steps = [model(idx[:, t:t + 1], cache=cache).logits for t in range(20)]
    step_masks = {}
    for index, _, mask in spy.calls:
        step_masks.setdefault(index, []).append(mask)
    for index, score, mask in full_calls:
        inc = torch.cat(step_masks[index], dim=1)
        clear = (score - model.stream.mod.threshold[index]).abs() > 1e-5
        assert torch.equal(inc[clear], mask[clear])
    assert any((~m).any() for _, _, m in full_calls)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4 * float(full.abs().max()), rtol=0)


# ----------------------------------------------------------------------------------------------------------
# The calibrator
# ----------------------------------------------------------------------------------------------------------
def test_histogram_quantile_matches_the_sample_quantile():
    gen = np.random.default_rng(0)
    samples = np.concatenate([gen.beta(5, 3, 20000), gen.uniform(0.2, 0.3, 5000)])
    bins = 2048
    hist = np.histogram(samples, bins=bins, range=(0, 1))[0]
    for rate in (0.05, 0.2, 0.5, 0.9):
        q = float(histogram_quantile(torch.tensor(hist, dtype=torch.float64)[None], rate))
        assert abs(q - np.quantile(samples, rate)) < 2.0 / bins
    assert float(histogram_quantile(torch.tensor(hist, dtype=torch.float64)[None], 0.0)) == EXECUTE_ALL
    assert float(histogram_quantile(torch.zeros(1, bins, dtype=torch.float64), 0.3)) == EXECUTE_ALL


def test_calibrator_thresholds_come_from_earlier_steps_and_ranks_agree():
    gen = torch.Generator().manual_seed(0)
    steps = [[torch.rand(4, 50, generator=gen) * 0.5 + 0.2 for _ in range(2)] for _ in range(3)]  # [step][rank]
    ranks = [MoDCalibrator(2, 0.25, [True, False], start_tokens=500) for _ in range(2)]
    single = MoDCalibrator(2, 0.25, [True, False], start_tokens=500)  # one process seeing both ranks' tokens

    for step, scores in enumerate(steps):
        for rank, cal in enumerate(ranks):
            threshold_in_use = float(cal.threshold[0])
            out = cal.select(0, scores[rank])
            assert cal.select(1, scores[rank]) is None  # ineligible: always everything
            if step < 2:  # 400 global tokens per step, start at 500: skipping from step 2
                assert out is None
            else:
                assert torch.equal(out.mask_BT, scores[rank] > threshold_in_use)
        single.select(0, torch.cat(scores))
        # every rank folds in the SUM of both ranks' counts (what the trainer's all-reduce gives)
        packs = [c.pending_counts() for c in ranks]
        fractions = [cal.update(lambda t, s=sum(packs): s.clone()) for cal in ranks]
        single_fr = single.update()
        assert fractions[0] == fractions[1] == pytest.approx(single_fr)
        torch.testing.assert_close(ranks[0].threshold, ranks[1].threshold)
        torch.testing.assert_close(ranks[0].threshold, single.threshold)
        assert fractions[0][1] == 1.0
        if step == 0:  # the threshold for step 1 is the 25% quantile of step 0's scores only
            q = float(torch.quantile(torch.cat(steps[0]).flatten().double(), 0.25))
            assert abs(float(ranks[0].threshold[0]) - q) < 2 / ranks[0].bins
            assert float(ranks[0].threshold[1]) == EXECUTE_ALL
    assert fractions[0][0] < 1.0 and bool(ranks[0].skipping[0]) and not bool(ranks[0].skipping[1])
    saved = ranks[0].state_dict()
    assert {"threshold", "histogram", "correction", "skipping", "tokens_seen", "executed_total",
            "tokens_total"} == set(saved)


def _fed_calibrator(mode, cap=0.6, p_thres=None, steps=12, weights=(1.0, 3.0, 1.0, 3.0, 2.0)):
    """A calibrator fed five sublayers with very different score distributions (Beta shapes from mostly small
    to mostly large rotations) for `steps` training steps; returns it and its per-step executed fractions."""
    n = len(weights)
    cal = MoDCalibrator(n, 0.2, [True] * n, mode=mode, work_weights=weights, max_sublayer_skip=cap, p_thres=p_thres)
    shapes = [(0.5, 4.0), (2.0, 2.0), (4.0, 1.0), (1.0, 1.0), (1.0, 6.0)]
    gen = torch.Generator().manual_seed(0)
    fractions = []
    for _ in range(steps):
        for index, (a, b) in enumerate(shapes):
            u = torch.rand(8, 256, generator=gen)  # Kumaraswamy(a, b): a closed-form Beta-like shape on [0, 1]
            cal.select(index, (1 - (1 - u) ** (1 / b)) ** (1 / a))
        fractions.append(cal.update())
    return cal, fractions


def _mean_executed(fractions, last):
    return [sum(f[i] for f in fractions[-last:]) / last for i in range(len(fractions[0]))]


def test_global_threshold_skips_the_work_target_with_adaptive_depth_and_no_starved_sublayer():
    cal, fractions = _fed_calibrator("global")
    executed = _mean_executed(fractions, 6)
    skip = [1 - f for f in executed]
    assert abs(cal.skip_rate_of(executed) - 0.2) <= 0.02, skip  # the work-weighted total
    assert max(skip) - min(skip) > 0.3, skip                     # depth adapts: very different rates
    assert max(skip) <= 0.6 + 0.02, skip                         # the ceiling (sampling noise only)
    assert skip[0] == max(skip) and skip[2] == min(skip)         # small rotations skip most
    thresholds = cal.threshold.tolist()
    capped = [i for i in range(5) if thresholds[i] < max(thresholds) - 1e-9]
    assert capped == [0]  # one threshold, except where the ceiling binds
    # without a ceiling the sublayer of small rotations would skip far more
    _, uncapped = _fed_calibrator("global", cap=None)
    assert 1 - _mean_executed(uncapped, 6)[0] > 0.7


def test_per_sublayer_mode_keeps_one_quantile_per_sublayer():
    cal, fractions = _fed_calibrator("per_sublayer", cap=None)
    skip = [1 - f for f in _mean_executed(fractions, 6)]
    assert all(abs(s - 0.2) <= 0.02 for s in skip), skip
    # the legacy rule exactly: the quantile of each histogram at skip_rate + its own correction
    expected = histogram_quantile(cal.histogram, cal.skip_rate + cal.correction).float()
    assert torch.equal(cal.threshold, expected)


def test_fixed_mode_uses_p_thres_under_the_ceiling():
    cal, fractions = _fed_calibrator("fixed", p_thres=0.3)
    thresholds = cal.threshold.tolist()
    # sublayers 0 and 4 would skip ~90% at 0.3: capped at 60%
    assert thresholds[1:4] == [pytest.approx(0.3)] * 3 and thresholds[0] < 0.3 and thresholds[4] < 0.3
    skip = [1 - f for f in fractions[-1]]
    assert max(skip[0], skip[4]) <= 0.62 and min(skip[0], skip[4]) > 0.55 and skip[2] < 0.05
    with pytest.raises(UserError, match="p_thres"):
        MoDCalibrator(2, 0.2, [True, True], mode="fixed")


def test_eligible_sublayers_modes_and_start():
    assert eligible_sublayers(2, "all") == [True] * 4
    assert eligible_sublayers(2, "attention") == [True, False, True, False]
    assert eligible_sublayers(2, "ffn") == [False, True, False, True]
    assert eligible_sublayers(4, "every_other") == [False, False, True, True] * 2
    with pytest.raises(UserError, match="model.mod.sublayers"):
        eligible_sublayers(1, "every_other")
    with pytest.raises(UserError, match="model.mod.sublayers"):
        eligible_sublayers(2, "odd")
    model = mod_model(sublayers="ffn").train()
    with torch.no_grad():
        model(_idx())
    fractions = model.mod_update()  # the first step runs everything; only the FFNs start skipping
    assert fractions == [1.0] * 4 and model.stream.mod.skipping.tolist() == [False, True, False, True]


def test_models_without_mod_have_no_calibrator():
    from tiny_models import tiny_model

    model = tiny_model("nag")
    assert model.mod_update() is None
    assert model.mod_summary() == {"skip_rate": 0.0, "executed_fractions": None}
    assert not any(".base" in n for n, _ in model.named_parameters())
    from nagmoe.model.mod_calibration import SkipRateUnavailable

    with pytest.raises(SkipRateUnavailable, match="trained without MoD"):  # the commands add "--skip-rate: "
        model.set_mod_skip_rate(0.2)


# ----------------------------------------------------------------------------------------------------------
# FLOPs are real
# ----------------------------------------------------------------------------------------------------------
def test_mod_flops_on_reference_paths_match_the_accounting(micro_config):
    """attention impl=math and the per-expert loop, so the counter sees every matmul: a MoD forward+backward
    costs flops_per_token(executed=realised) and is below the full-depth count by the skipped work."""
    cfg = micro_config("model.attention.impl=math", "model.moe.impl=loop", "model.mod.skip_rate=0.3",
                       "model.nag.warmup_tokens=0")
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    B, T = 4, cfg.data.seq_len
    idx = torch.randint(0, cfg.model.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(idx)
    model.mod_update()

    def measure():
        with flop_counter() as counter:
            out = model(idx, idx)
            (out.loss + out.aux_loss).backward()
        model.zero_grad(set_to_none=True)
        return counter.get_total_flops() / (B * T), model.mod_update()

    mod_measured, realised = measure()
    assert 0.6 < sum(realised) / len(realised) < 0.8
    model.set_mod_skip_rate(0.0)
    full_measured, full_fr = measure()
    assert full_fr == [1.0] * len(full_fr)
    mod_expected = flops_per_token(cfg.model, T, realised)
    full_expected = flops_per_token(cfg.model, T, 1.0)
    assert mod_measured == pytest.approx(mod_expected, rel=0.05)
    assert full_measured == pytest.approx(full_expected, rel=0.05)
    assert full_measured - mod_measured == pytest.approx(full_expected - mod_expected, rel=0.1)
