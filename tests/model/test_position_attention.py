"""The chunked CPU kernel for MoD's executed queries (nagmoe/ops/position_attention.py): unmasked prefix calls
and one masked call inside each chunk, merged by log-sum-exp, equal the math path's rows and gradients — for
GQA, sequences with different counts (padding slots), chunks with no executed query, a last partial chunk —
and it is what sdpa runs on CPU for MoD's attention."""
import pytest
import torch

import nagmoe.model.attention as attention_module
from nagmoe.model.attention import attention_at_positions, causal_attention
from nagmoe.model.mod import ExecutedTokens
from nagmoe.ops.position_attention import chunked_position_attention
from test_mod import mod_model


@pytest.fixture
def chunked_calls(monkeypatch):
    """Counts the calls attention_at_positions makes to the chunked kernel (so a silent fallback fails)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[3].shape)
        return chunked_position_attention(*args, **kwargs)

    monkeypatch.setattr(attention_module, "chunked_position_attention", counted)
    return calls


CASES = {  # B, H, K, T, S, chunk, executed probability per sequence
    "gqa, padding, partial last chunk": (3, 4, 2, 70, 8, 16, (0.8, 0.4, 0.1)),
    "one chunk (the blocked sdpa runs)": (2, 2, 2, 33, 8, 64, (0.7, 0.5)),
    "many small chunks": (2, 2, 1, 64, 8, 8, (0.9, 0.6)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_chunked_kernel_equals_the_math_reference_with_gradients(case, chunked_calls):
    B, H, K, T, S, chunk, keep = CASES[case]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, T, S, generator=gen, requires_grad=True)
    k = torch.randn(B, K, T, S, generator=gen, requires_grad=True)
    v = torch.randn(B, K, T, S, generator=gen, requires_grad=True)
    mask = torch.rand(B, T, generator=gen) < torch.tensor(keep).unsqueeze(1)
    mask[0, 0] = True  # a query at position 0 (sees one key)
    mask[-1, chunk:2 * chunk] = False  # a chunk with no executed query in one sequence
    if B > 2:
        mask[1, 2 * chunk:] = False  # ... and in every sequence but one
        mask[2, :] = False
        mask[2, T - 1] = True  # a single, last query: the most padding slots
    sel = ExecutedTokens(mask, chunk=chunk)
    positions, _ = sel.padded()
    q_BHMS = sel.to_padded(sel.gather(q.transpose(1, 2))).transpose(1, 2)
    got = sel.from_padded(attention_at_positions(q_BHMS, k, v, "sdpa", positions,
                                                 chunks=sel.position_chunks(0)).transpose(1, 2))
    ref = sel.from_padded(attention_at_positions(q_BHMS, k, v, "math", positions).transpose(1, 2))
    assert len(chunked_calls) == (T > chunk)
    rows = sel.gather(causal_attention(q, k, v, "math").transpose(1, 2))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, rows, atol=1e-5, rtol=1e-5)
    probe = torch.randn(got.shape, generator=gen)
    grads = torch.autograd.grad((got * probe).sum(), (q, k, v), retain_graph=True)  # shares the gather
    ref_grads = torch.autograd.grad((ref * probe).sum(), (q, k, v))
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=lambda m: f"grad {name}: {m}")


def test_chunk_rows_are_the_most_executed_tokens_of_one_sequence_per_chunk():
    mask = torch.tensor([[1, 1, 0, 1, 0, 0, 1], [0, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    sel = ExecutedTokens(mask, chunk=3)
    assert sel.chunk_rows == [2, 2, 1]  # chunks [0, 3), [3, 6), [6, 7)
    assert sel.key_ends is not None and len(sel.key_ends) == sel.M
    assert sel.position_chunks(0)[1:] == ([2, 2, 1], 3)
    assert sel.position_chunks(5) is None  # after a cached prefix: the blocked path
    assert ExecutedTokens(mask, queries=False).position_chunks(0) is None


@pytest.mark.parametrize("attention", ["gqa", "ccgqa"])
def test_mod_attention_runs_the_chunked_kernel_and_returns_the_full_rows(attention, chunked_calls):
    """Through the attention modules (CCA's latent queries, GQA's gathered queries), several chunks per
    sequence: the executed rows of the full causal attention, and their gradients."""
    model = mod_model(attention, "sdpa")
    attn = model.blocks[1].attn
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 40, 32, generator=gen, requires_grad=True)
    mask = torch.rand(3, 40, generator=gen) > torch.tensor([[0.2], [0.5], [0.9]])
    full, _ = attn(x)
    part, _ = attn(x, select=ExecutedTokens(mask, chunk=8))
    assert len(chunked_calls) == 1
    torch.testing.assert_close(part, full[mask], atol=1e-5, rtol=1e-5)
    probe = torch.randn(part.shape, generator=gen)
    g_part, = torch.autograd.grad((part * probe).sum(), x)
    g_full, = torch.autograd.grad((full[mask] * probe).sum(), x)
    torch.testing.assert_close(g_part, g_full, atol=1e-5, rtol=1e-5)
