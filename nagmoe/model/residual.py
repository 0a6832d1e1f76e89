"""Residual streams: how the stream is encoded from the embedding, how a sublayer's output enters it, and
how it is decoded into logits. Chosen by `model.residual` through `RESIDUAL_STREAMS` (name -> class).

Legend: B batch, T sequence, D model width, V vocabulary, C modulator directions.

The transformer's loop is the same for every stream:
    state = stream.encode(wte, idx_BT)
    for index, sublayer in enumerate(sublayers):          # index k = NAG sublayer l - 1
        state, aux = stream.apply(index, sublayer, state)
    logits_BTV = stream.decode(state, lm_head)             # fp32
The sublayer contract: `sublayer(x_BTD) -> (y_BTD, aux or None)` or `(y_BTD, aux or None, gate_scale_BT)`.
`gate_scale_BT` (only a MoE feeding a NAG stream with model.moe.gate_grad=step_gain returns one) is S /
stopgrad(S) for the token's summed gate weight S: 1 in the forward; NAG multiplies it into its step gain so
the router gets the gradient the normalised branch output would otherwise cancel. Pre-norm ignores it.
Each call takes an optional `stats` (a StatsCollector); with `stats=None` nothing extra is computed.
A stream only *calls* `sublayer(x_BTD)` (no attribute access): when decoding, the transformer passes the
attention sublayer with its inference cache bound (`functools.partial(attn, cache=...)`). Both streams are
per-token maps around the sublayers, so they need no decoding state of their own.
Under MoD (NAG only, `model.mod.skip_rate > 0`) the stream also calls `sublayer(x_BTD, select=executed)`,
which returns `(y_ND, aux[, gate_scale_N])` for the executed tokens only (nagmoe/model/mod.py).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from nagmoe.model.roles import GATE, SCALAR
from nagmoe.model.common import rms_norm
from nagmoe.model.init_rng import ParamInit
from nagmoe.config.flops import skippable_flops_per_sublayer
from nagmoe.model.mod import Selection, eligible_sublayers
from nagmoe.model.mod_calibration import MoDCalibrator
from nagmoe.model.nag import modulator, rms_normalise, rotation_score
from nagmoe.model.stats import StatsCollector, mean_angle, mean_log_rms, mean_rms
from nagmoe.ops.nag_fused import NAGOps

_TINY = 1e-12


def compute_dtype(like: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for this device, else the tensor's own dtype."""
    if torch.is_autocast_enabled(like.device.type):
        return torch.get_autocast_dtype(like.device.type)
    return like.dtype


# `train.precision` (docs/architecture.md, "precision policy"): `uniform` (new runs) gives both streams the same
# numerics: an fp32 carrier, matmul inputs in the autocast dtype, the unembedding matmul too; `legacy` (run
# dirs from before the key) keeps NAG's direction in the compute dtype and its decode an fp32 matmul.
PRECISIONS = ("uniform", "legacy")


class ResidualStream(nn.Module):
    """Interface. `head_init_std` is the std the transformer initialises the unembedding with."""

    def __init__(self, model_cfg, n_sublayers: int):
        super().__init__()
        self.d_model = model_cfg.d_model
        self.n_sublayers = n_sublayers
        self.precision = "uniform"  # Transformer.set_precision

    def head_init_std(self) -> float:
        raise NotImplementedError

    def encode(self, wte: nn.Embedding, idx_BT: torch.Tensor, stats: Optional[StatsCollector] = None):
        raise NotImplementedError

    def apply(self, index: int, sublayer: nn.Module, state, stats: Optional[StatsCollector] = None):
        raise NotImplementedError

    def decode(self, state, lm_head: nn.Linear, stats: Optional[StatsCollector] = None) -> torch.Tensor:
        """fp32 logits (B, T, V) of the final state."""
        return self.decode_with(state, self.decode_weight(lm_head))

    def decode_weight(self, lm_head: nn.Linear) -> torch.Tensor:
        """The (V, D) matrix the logits are read with (computed once; a chunked loss reuses it per chunk)."""
        raise NotImplementedError

    def decode_with(self, state, w_VD: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def set_injection_warmup(self, factor: float) -> None:
        """Only NAG has an injection warm-up; other streams ignore it."""


# ----------------------------------------------------------------------------------------------------------
# Pre-norm baseline
# ----------------------------------------------------------------------------------------------------------
class PreNormResidual(ResidualStream):
    """x0 = rmsnorm(wte[idx]) (nanochat); x <- x + f(rmsnorm(x)); logits = softcap·tanh(head(rmsnorm(x)) / softcap).

    A softcap <= 0 turns the cap off."""

    def __init__(self, model_cfg, n_sublayers: int):
        super().__init__(model_cfg, n_sublayers)
        self.logit_softcap = model_cfg.logit_softcap

    def head_init_std(self) -> float:
        return 0.001  # nanochat: a near-zero head, so the first logits are ~uniform

    def encode(self, wte, idx_BT, stats=None):
        return rms_norm(wte(idx_BT))

    def apply(self, index, sublayer, x_BTD, stats=None):
        y_BTD, aux = sublayer(rms_norm(x_BTD))[:2]  # the gate scale is NAG's (module docstring)
        out_BTD = x_BTD + y_BTD
        if stats is not None:
            stats.add_sublayer(
                log_norm_in=mean_log_rms(x_BTD), log_norm_out=mean_log_rms(out_BTD),
                rotation_angle=mean_angle(x_BTD, out_BTD),
                stream_rms_in=mean_rms(x_BTD), stream_rms_out=mean_rms(out_BTD))
        return out_BTD, aux

    def decode_weight(self, lm_head):
        return lm_head.weight

    def decode_with(self, x_BTD, w_VD):
        logits_BTV = F.linear(rms_norm(x_BTD), w_VD).float()  # under autocast: bf16 inputs, fp32 accumulation
        if self.logit_softcap > 0:
            logits_BTV = self.logit_softcap * torch.tanh(logits_BTV / self.logit_softcap)
        return logits_BTV


# ----------------------------------------------------------------------------------------------------------
# NAG: two lanes, direction (RMS 1, compute dtype) and log-norm (fp32)
# ----------------------------------------------------------------------------------------------------------
def _unpack(out: tuple) -> tuple:
    """(y, aux, gate_scale or None) from a sublayer's output (the contract in the module docstring)."""
    return out[0], out[1], (out[2] if len(out) > 2 else None)


class NAGState(NamedTuple):
    log_norm_BT: torch.Tensor  # s = log rho, fp32
    direction_BTD: torch.Tensor  # R_bar, RMS 1, compute dtype


class NAGGate(nn.Module):
    """The gate of one NAG sublayer: the modulator m(R_bar) ∈ [0, 1] and the ceiling alpha.

    Init (reference/nag.md): weight ~ N(0, 1/d), bias 0, coef 0 (uniform softmax), softplus(beta_raw) =
    beta_init, alpha = l^(-1/2) for the 1-based sublayer index l. With `mod_base` (MoD) also the base vector
    `base (d,)`: X_l, added to every token's branch output. `base_init_std` 0 (model.mod.base_init_std, the
    default) starts it at zero like every branch's output projection: a nonzero X_l while the branches are
    still zero would rotate every token towards the same direction, collapsing the routers' inputs
    (docs/decisions.md); nag_update's eps keeps the Jacobian at f⊥ = 0 finite, so X_l learns from the first
    step either way. The legacy value is 0.02 (N(0, 0.02²))."""

    param_roles = {"weight": GATE, "bias": GATE, "coef": GATE, "beta_raw": GATE, "alpha": GATE, "base": GATE}

    def __init__(self, d_model: int, n_directions: int, sublayer_number: int, beta_init: float = 1.0,
                 floor: float = 1e-6, mod_base: bool = False, base_init_std: float = 0.02):
        super().__init__()
        self.d_model = d_model
        self.sublayer_number = sublayer_number
        self.beta_init = beta_init
        self.floor = floor
        self.weight = nn.Parameter(torch.empty(n_directions, d_model))
        self.bias = nn.Parameter(torch.empty(n_directions))
        self.coef = nn.Parameter(torch.empty(n_directions))
        self.beta_raw = nn.Parameter(torch.empty(()))
        self.alpha = nn.Parameter(torch.empty(()))
        self.base_init_std = base_init_std
        self.base = nn.Parameter(torch.empty(d_model)) if mod_base else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.init_weights(ParamInit())

    def init_weights(self, init: ParamInit) -> None:
        init.normal_(self, "weight", self.d_model ** -0.5)
        init.zeros_(self, "bias")
        init.zeros_(self, "coef")
        init.fill_(self, "beta_raw", math.log(math.expm1(self.beta_init)))  # softplus^-1(beta_init)
        init.fill_(self, "alpha", self.sublayer_number ** -0.5)
        if self.base is not None and self.base_init_std > 0:
            init.normal_(self, "base", self.base_init_std)
        elif self.base is not None:
            init.zeros_(self, "base")

    def modulator(self, direction_BTD: torch.Tensor) -> torch.Tensor:
        return modulator(direction_BTD, self.weight, self.bias, self.coef, self.beta_raw, self.floor)

    def beta(self) -> torch.Tensor:
        return F.softplus(self.beta_raw.float())


class NAGResidual(ResidualStream):
    """Norm-agnostic residual stream (reference/nag.md).

    encode: e = centre(wte[idx]) (centred in the forward, not normalised);
            s0 = log RMS(e) + g_encode;  R_bar0 = e / RMS(e)
    apply:  m = modulator(R_bar); g = alpha·m·warmup; f = F(R_bar); (s, R_bar) <- nag_update(s, R_bar, f, g)
            (modulator and update through `self.ops`: eager or fused, `model.nag.impl`, nagmoe/ops/nag_fused.py)
    decode: W = rms_normalise(centre(W_U)) in the forward;  logits = exp(s_L)·cos(R_bar_L, W[v]), fp32, no cap.
    MoD (model.mod.skip_rate > 0): r = rotation_score(alpha, m); F runs on the tokens with r > threshold
    (`self.mod`, a MoDCalibrator); f = F(R_bar) + X_l for those, f = X_l for the others (X_l = gate.base, on
    every sublayer, also ineligible ones and before the start, so the architecture never changes).
    """

    param_roles = {"g_encode": SCALAR}

    def __init__(self, model_cfg, n_sublayers: int):
        super().__init__(model_cfg, n_sublayers)
        nag = model_cfg.nag
        self.eps = nag.eps
        self.init_std = model_cfg.init_std if model_cfg.init_std is not None else model_cfg.d_model ** -0.5
        self.g_encode = nn.Parameter(torch.zeros((), dtype=torch.float32))  # log-space encode gain
        mod = model_cfg.mod
        self.gates = nn.ModuleList(
            NAGGate(model_cfg.d_model, nag.C, index + 1, nag.beta_init, nag.gain_floor, mod_base=mod.skip_rate > 0,
                    base_init_std=mod.base_init_std)
            for index in range(n_sublayers))
        # model.nag.impl: the fused (compiled) or eager NAG update and modulator, `auto` resolved per device
        # from the tensors a call gets (nagmoe/ops/nag_fused.py): the stream is built on meta, placed later
        self.ops = NAGOps(nag.impl)
        self.mod = None
        if mod.skip_rate > 0:  # skipping starts after the injection warm-up (and model.mod.start_tokens)
            # work weights at max_seq_len; the trainer and the run loaders re-set them at data.seq_len
            self.mod = MoDCalibrator(n_sublayers, mod.skip_rate, eligible_sublayers(n_sublayers // 2, mod.sublayers),
                                     start_tokens=max(mod.start_tokens, nag.warmup_tokens),
                                     mode=mod.threshold,
                                     work_weights=skippable_flops_per_sublayer(model_cfg, model_cfg.max_seq_len),
                                     max_sublayer_skip=mod.max_sublayer_skip,
                                     p_thres=mod.p_thres, impl=mod.impl)
        # Injection warm-up factor in [0, 1], set by the trainer each step; not saved (the trainer re-sets it).
        self.register_buffer("injection_warmup", torch.ones((), dtype=torch.float32), persistent=False)

    @property
    def impl(self) -> str:
        """The NAG backend for where the stream lives (trainer.backends' NAGResidual.impl, bench tools)."""
        return self.ops.backend_for(self.g_encode.device)

    def init_weights(self, init: ParamInit) -> None:
        """The stream's own parameter (the gates initialise themselves): g_encode = 0."""
        init.zeros_(self, "g_encode")

    def reset_buffers(self) -> None:
        """A fresh stream's buffer values (after meta-device construction, nagmoe/model/init_rng.py)."""
        self.injection_warmup.fill_(1.0)

    def head_init_std(self) -> float:
        return self.init_std  # rows are renormalised in the forward; only their direction matters

    def set_injection_warmup(self, factor: float) -> None:
        self.injection_warmup.fill_(float(factor))

    def encode(self, wte, idx_BT, stats=None):
        e_BTD = wte(idx_BT).float()
        e_BTD = e_BTD - e_BTD.mean(-1, keepdim=True)
        mean_sq_BT = e_BTD.pow(2).mean(-1)
        log_norm_BT = 0.5 * torch.log(mean_sq_BT + _TINY) + self.g_encode.float()
        direction_BTD = e_BTD * torch.rsqrt(mean_sq_BT + _TINY).unsqueeze(-1)
        if stats is not None:
            stats.add_scalar(g_encode=self.g_encode, injection_warmup=self.injection_warmup)
        if self.precision == "legacy":  # the direction lane in the compute dtype
            direction_BTD = direction_BTD.to(compute_dtype(wte.weight))
        return NAGState(log_norm_BT, direction_BTD)

    def apply(self, index, sublayer, state, stats=None):
        log_norm_BT, direction_BTD = state
        gate = self.gates[index]
        select = None
        if self.mod is None:  # the modulator is needed only by the update: one fused region for both
            f_BTD, aux, gate_scale_BT = _unpack(sublayer(direction_BTD))
            new_log_norm_BT, new_direction_BTD, m_BT, scale_BT = self.ops.gated_update(
                log_norm_BT, direction_BTD, f_BTD, gate.weight, gate.bias, gate.coef, gate.beta_raw, gate.alpha,
                self.injection_warmup, gate.floor, self.eps, gate_scale_BT)
        else:
            m_BT = self.ops.modulator(direction_BTD, gate.weight, gate.bias, gate.coef, gate.beta_raw, gate.floor)
            scale_BT = gate.alpha.float() * m_BT * self.injection_warmup
            score_BT = rotation_score(gate.alpha.detach(), m_BT.detach())  # a decision: no gradient
            select = self.mod.select(index, score_BT)
            if select is None:  # every token executes (ineligible, or before the start)
                f_BTD, aux, gate_scale_BT = _unpack(sublayer(direction_BTD))
                f_BTD = f_BTD + gate.base.to(f_BTD.dtype)  # F(R_bar) + X_l
            elif isinstance(select, Selection):  # static: every row computed, the skipped ones discarded
                # the decision (mask, counts, histogram) is made where the sublayer runs: in its compiled unit
                y_BTD, aux, gate_scale_BT = _unpack(sublayer(direction_BTD, select=select))
                self.mod.record(index, select)
                new_log_norm_BT, new_direction_BTD = self.ops.masked_update(  # one region (nag_fused.py)
                    log_norm_BT, direction_BTD, y_BTD, gate.base, select.mask_BT, scale_BT, self.eps, gate_scale_BT)
            else:  # F on the executed tokens only: X_l + F(R_bar) executed, X_l skipped, in one pass
                y_ND, aux, gate_scale_N = _unpack(sublayer(direction_BTD, select=select))
                f_BTD = select.scatter_onto(gate.base, y_ND)
                gate_scale_BT = (None if gate_scale_N is None  # 1 for skipped tokens, S / sg(S) for executed
                                 else select.scatter_onto(gate_scale_N.new_ones(()), gate_scale_N - 1.0))
            if not isinstance(select, Selection):
                step_BT = scale_BT if gate_scale_BT is None else scale_BT * gate_scale_BT
                new_log_norm_BT, new_direction_BTD = self.ops.update(log_norm_BT, direction_BTD, f_BTD, step_BT,
                                                                     self.eps)
        if stats is not None:
            self._record(stats, gate, state, new_log_norm_BT, new_direction_BTD, m_BT, scale_BT, select)
        return NAGState(new_log_norm_BT, new_direction_BTD), aux

    def decode_weight(self, lm_head):
        with torch.autocast(device_type=lm_head.weight.device.type, enabled=False):
            w_VD = lm_head.weight.float()
            return rms_normalise(w_VD - w_VD.mean(-1, keepdim=True))

    def decode_with(self, state, w_VD):
        log_norm_BT, direction_BTD = state
        dtype = compute_dtype(w_VD) if self.precision == "uniform" else torch.float32
        with torch.autocast(device_type=direction_BTD.device.type, enabled=False):
            # both sides RMS 1, i.e. norm sqrt(d): cos = <R_bar, W[v]> / d; the per-token factor exp(s)/d is
            # folded into the (B, T, D) side so only one (B, T, V) tensor is allocated. `uniform`: the matmul
            # in the compute dtype (fp32 accumulation) like the pre-norm head; `legacy`: in fp32.
            factor_BT = log_norm_BT.float().exp() / self.d_model
            a_BTD = rms_normalise(direction_BTD.float()) * factor_BT.unsqueeze(-1)
            return F.linear(a_BTD.to(dtype), w_VD.to(dtype)).float()

    @torch.no_grad()
    def _record(self, stats, gate, state_in, log_norm_BT, direction_BTD, m_BT, scale_BT, select=None):
        # the modulator base sits at the floor exactly when m = floor ** beta
        at_floor = m_BT <= (gate.floor ** gate.beta()) * (1 + 1e-4)
        stats.add_sublayer(
            log_norm_in=state_in.log_norm_BT.mean(), log_norm_out=log_norm_BT.mean(),
            rotation_angle=mean_angle(state_in.direction_BTD, direction_BTD),
            alpha=gate.alpha, beta=gate.beta(),
            m_mean=m_BT.mean(), m_min=m_BT.min(), m_floor_frac=at_floor.float().mean(),
            gain_mean=scale_BT.abs().mean())
        if self.mod is not None:
            stats.add_sublayer(
                score_mean=rotation_score(gate.alpha, m_BT).mean(),
                executed_frac=1.0 if select is None else
                select.mask_BT.float().mean() if isinstance(select, Selection) else select.n / max(1, m_BT.numel()))


RESIDUAL_STREAMS = {"prenorm": PreNormResidual, "nag": NAGResidual}


def build_residual_stream(model_cfg, n_sublayers: int) -> ResidualStream:
    return RESIDUAL_STREAMS[model_cfg.residual](model_cfg, n_sublayers)
