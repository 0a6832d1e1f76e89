"""A small model that declares parameter roles like the real one (nagmoe/model/roles.py), for optimizer and
checkpoint tests: 2-D gates and router, a conv kernel, scalars, an embedding, an untied head, dense
matrices and a 3-D expert stack. It is not the real model (written concurrently elsewhere)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nagmoe.model.roles import GATE, MATRIX, ROUTER, SCALAR, UNEMBEDDING


class ToyGate(nn.Module):
    param_roles = {"weight": GATE, "bias": GATE, "coef": GATE, "beta_raw": GATE, "alpha": GATE}

    def __init__(self, d: int, c: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(c, d) / d ** 0.5)
        self.bias = nn.Parameter(torch.zeros(c))
        self.coef = nn.Parameter(torch.zeros(c))
        self.beta_raw = nn.Parameter(torch.tensor(0.5413))
        self.alpha = nn.Parameter(torch.tensor(1.0))

    def forward(self, x_BTD):
        m = (torch.softmax(self.coef, 0) * torch.sigmoid(x_BTD @ self.weight.T + self.bias)).sum(-1)
        return self.alpha * m.clamp_min(1e-6) ** F.softplus(self.beta_raw)


class ToyMoE(nn.Module):
    param_roles = {"w_in": MATRIX, "w_out": MATRIX}

    def __init__(self, d: int, hidden: int, n_experts: int):
        super().__init__()
        self.router = nn.Linear(d, n_experts, bias=False)
        self.router.param_roles = {"weight": ROUTER}
        self.w_in = nn.Parameter(torch.randn(n_experts, d, hidden) / d ** 0.5)
        self.w_out = nn.Parameter(torch.randn(n_experts, hidden, d) / hidden ** 0.5)

    def forward(self, x_BTD):
        probs_BTE = torch.softmax(self.router(x_BTD), -1)
        h_EBTH = torch.relu(torch.einsum("btd,edh->ebth", x_BTD, self.w_in)) ** 2
        y_EBTD = torch.einsum("ebth,ehd->ebtd", h_EBTH, self.w_out)
        return torch.einsum("bte,ebtd->btd", probs_BTE, y_EBTD)


class ToyBlock(nn.Module):
    def __init__(self, d: int, n_experts: int):
        super().__init__()
        self.c_q = nn.Linear(d, d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.gate = ToyGate(d, 4)
        self.moe = ToyMoE(d, 2 * d, n_experts)

    def forward(self, x_BTD):
        x_BTD = x_BTD + self.gate(x_BTD).unsqueeze(-1) * self.c_proj(torch.relu(self.c_q(x_BTD)))
        return x_BTD + self.moe(x_BTD)


class ToyModel(nn.Module):
    param_roles = {"g_encode": SCALAR}

    def __init__(self, vocab: int = 32, d: int = 16, n_layers: int = 2, n_experts: int = 3):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.conv = nn.Conv1d(d, d, kernel_size=2, groups=d)
        self.g_encode = nn.Parameter(torch.tensor(1.0))
        self.blocks = nn.ModuleList(ToyBlock(d, n_experts) for _ in range(n_layers))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.param_roles = {"weight": UNEMBEDDING}

    def forward(self, idx_BT, targets_BT):
        x_BTD = self.wte(idx_BT)
        T = idx_BT.size(1)
        x_BTD = x_BTD + self.conv(F.pad(x_BTD.transpose(1, 2), (1, 0))).transpose(1, 2)[:, :T]
        x_BTD = x_BTD * self.g_encode
        for block in self.blocks:
            x_BTD = block(x_BTD)
        logits = self.lm_head(F.rms_norm(x_BTD, (x_BTD.size(-1),)))
        return F.cross_entropy(logits.flatten(0, 1), targets_BT.flatten())


EXPECTED_MUON = [f"blocks.{i}.{n}" for i in range(2) for n in
                 ("c_q.weight", "c_proj.weight", "moe.w_in", "moe.w_out")]


def toy_batch(seed: int = 0, vocab: int = 32, batch: int = 4, seq: int = 8):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]
