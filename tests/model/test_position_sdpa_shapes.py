"""Issue 59, build 1: MoD's position-blocked SDPA calls never take cuDNN (its plan cache is per exact shape,
and these shapes are data-dependent) and their key lengths are multiples of KEY_ROUNDING (or all L keys), so a
run meets a finite set of shapes. Checked on the CPU: the enabled-backend flags SDPA reads at call time are
torch's global ones on every device, and the shapes are the caller's."""
import torch
import torch.nn.functional as F

from nagmoe.model import attention
from nagmoe.model.attention import attention_at_positions
from nagmoe.model.mod import ExecutedTokens

KEY_ROUNDING = 256  # the rounding (nagmoe.model.attention.KEY_ROUNDING)


def test_blocked_calls_never_cudnn_and_key_lengths_are_rounded(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, *args, **kwargs):
        calls.append((k.shape[2], torch.backends.cuda.cudnn_sdp_enabled()))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording_sdpa)
    torch.manual_seed(0)
    B, H, T, S = 2, 2, 1100, 8
    k, v = torch.randn(B, H, T, S), torch.randn(B, H, T, S)
    for rate in (0.3, 0.5, 0.7):
        sel = ExecutedTokens(torch.rand(B, T) > rate)
        positions_BM, _ = sel.padded()
        q = torch.randn(B, H, sel.M, S)
        got = attention_at_positions(q, k, v, "sdpa", positions_BM, key_ends=sel.key_ends)
        ref = attention_at_positions(q, k, v, "math", positions_BM)
        valid = sel.padded()[1]
        # the same softmax over the same visible keys; fp32, kernels differ in summation order only
        torch.testing.assert_close(got.transpose(1, 2)[valid], ref.transpose(1, 2)[valid], rtol=1e-5, atol=1e-5)
    assert calls and all(not cudnn for _, cudnn in calls), calls
    lengths = {keys for keys, _ in calls}
    assert all(keys % KEY_ROUNDING == 0 or keys == T for keys in lengths), sorted(lengths)
    assert torch.backends.cuda.cudnn_sdp_enabled() or not torch.backends.cuda.is_built()  # restored after
