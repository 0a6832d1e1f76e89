"""The paper's nag-mod20-r40 layout at reduced width, with the MoD helpers the static-MoD tests share
(tests/model/test_mod_static.py, tests/perf/test_compiled_mod_static.py, tests/parallel/test_ep_mod_static.py)."""
import os

import torch

from nagmoe.config import load_config
from nagmoe.model import build_model
from tiny_models import randomize_output_projections

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support/..
B, T = 4, 64


def r40_small(impl="gather", **extra):
    cfg = load_config(os.path.join(REPO, "configs/paper/nag-mod20-r40.yaml"), [
        "model.d_model=64", "model.n_layers=2", "model.vocab_size=256", "model.max_seq_len=64",
        "model.moe.n_experts=8", "model.moe.expert_hidden=32", "model.nag.C=8", "model.nag.warmup_tokens=0",
        "model.mod.start_tokens=0", "model.mod.base_init_std=0.02", "data.seq_len=64", f"model.mod.impl={impl}",
        *[f"{k}={v}" for k, v in extra.items()]])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    randomize_output_projections(model, 0)
    with torch.no_grad():  # the zero-initialised experts' output too: every sublayer moves the stream
        for name, p in model.named_parameters():
            if name.endswith("w_out"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * p.shape[1] ** -0.5)
    return model


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, T), generator=gen), torch.randint(0, 256, (B, T), generator=gen)


def with_edge_rows(model):
    """Row 0 executes nothing, row 1 everything, at every eligible sublayer (scores 0 and 1)."""
    cal = model.stream.mod
    real = cal.select

    def select(index, score_BT):
        score_BT = score_BT.detach().clone()
        score_BT[0], score_BT[1] = 0.0, 1.0
        return real(index, score_BT)

    cal.select = select
    return model


def dialled(model, rate):
    """Histograms from one training forward, then the dial at `rate`; the step's counts cleared."""
    model.train()
    with torch.no_grad():
        model(batch(99)[0])
    model.mod_update()
    model.set_mod_skip_rate(rate)
    return model


def recording_backend():
    """An aot_eager compile backend that keeps what it is given: `(backend, graphs, fw_graphs, bw_graphs)`, dynamo's
    graphs and the forward and backward graphs aot_autograd traces from them (as inductor would get them)."""
    graphs, fw_graphs, bw_graphs = [], [], []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: fw_graphs.append(g) or g,
                                                          bw_compiler=lambda g, _: bw_graphs.append(g) or g)(
            gm, example_inputs)

    return backend, graphs, fw_graphs, bw_graphs


def step(model, idx, targets):
    model.zero_grad(set_to_none=True)
    out = model(idx, targets)
    (out.loss + out.aux_loss).backward()
    return out
