"""torch's FlopCounterMode with a corrected grouped-conv backward, for the FLOP accounting's tests (tests/config/
test_flops.py, tests/model/test_mod.py; docs/decisions.md)."""
import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count


def _conv_backward_flop(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                        _output_padding, _groups, output_mask, out_shape=None, **kwargs):
    """Backward of a (non-transposed) conv: grad_input and grad_weight each cost the forward's FLOPs.
    torch's own formula (torch 2.13) drops the group division in grad_weight, which overcounts grouped and
    depthwise convs (CCA's) by up to the channel count; see pytorch/pytorch PR #183405."""
    assert not transposed
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def flop_counter():
    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: _conv_backward_flop})
