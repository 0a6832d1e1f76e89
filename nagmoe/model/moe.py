"""Dropless token-choice top-k Mixture-of-Experts FFN with ReLU² experts and auxiliary losses on autograd.

Shape legend: B batch, T sequence length, D model width, N = B·T tokens of the micro-batch, E experts,
K = top_k, H expert hidden width, S = N·K routing slots (one per (token, choice) pair).

Pipeline of one forward call:
  1. route    logits_NE = x_ND @ W_rᵀ in fp32 (autocast off); probs_NE = softmax; top-k -> expert_NK, gate_NK.
              Gate weights are the raw top-k softmax probabilities, NOT renormalised over the k (as OLMoE):
              under pre-norm the LM loss then reaches the router through the gates even for top-1, and a
              token whose probability mass is spread over unchosen experts gets a smaller update. Under NAG
              the branch output is normalised (u = sqrt(d)·f⊥/||f⊥||), so the summed gate weight
              S = Σ_k gate_k cancels (exactly for top-1): with `gate_scale_output` the layer also returns
              gate_scale_N = S / stopgrad(S) (= 1 in the forward), which the NAG stream multiplies into the
              step gain, so ∂L/∂log S = g·∂L/∂g (docs/decisions.md, "router gradient under NAG").
              With `model.moe.expert_bias` the top-k is taken of probs_NE + b (no gradient) and the gates are
              probs_NE at the chosen experts: logits, probabilities and both auxiliary losses are unchanged.
  2. dispatch slots sorted by expert (stable argsort), each slot a copy of its token: x_SD. Dropless unless
              `model.moe.capacity_factor` f is set and the layer is training: then expert e keeps the first
              C = ceil(f·N·K/E) of its slots in token order (a later token never displaces an earlier one)
              and the rest get no expert output (y = 0 for that slot; a token with every slot dropped has
              f = 0: no NAG update, under MoD the base update only). This bounds what an expert-parallel rank
              receives from each source to C rows per local expert.
  3. experts  y_SD = relu(x_SD @ w_in[e])² @ w_out[e], by the backend from `nagmoe.ops.grouped_experts`.
              Static MoD (`select=`, model.mod.impl=static): every token is routed, the skipped ones' slots sort
              last (and dropped ones after them), the experts run the leading executed slots only and the tail is
              masked with torch.where; losses and statistics count the executed tokens (`_slots_live`).
  4. combine  unpermute the slots back to (N, K, D) and sum with the gate weights,
              y_ND = Σ_k gate_NK · y_NKD. A permutation + sum over K instead of index_add: no colliding
              scatter, so CUDA runs are deterministic too. Both permutations (dispatch, unsort) are gathers whose
              backward is a gather by the inverse permutation (nagmoe/ops/permute.py): no index_put into a
              zero-filled buffer either way.
  The expert stacks reach the experts in their compute dtype cast once per weight write, not per micro-step
  or recompute (`weight_casts`, nagmoe/ops/cast_cache.py; a compiled unit gets them from the pre-hook).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from nagmoe.config import MoEConfig
from nagmoe.base.errors import UserError
from nagmoe.model.init_rng import ParamInit
from nagmoe.model.mod import decide
from nagmoe.model.roles import MATRIX, ROUTER
from nagmoe.ops.cast_cache import WeightCastCache
from nagmoe.ops.grouped_experts import EXPERT_FORWARD, expert_compute_dtype, expert_path, resolve_expert_backend
from nagmoe.ops.permute import inverse_permutation, permute_rows


class Router(nn.Linear):
    """`Linear(d, E, bias=False)` whose weight is an AdamW "router" parameter (never Muon); logits in fp32."""

    param_roles = {"weight": ROUTER}

    def __init__(self, d_model: int, n_experts: int):
        super().__init__(d_model, n_experts, bias=False)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x_ND.device.type, enabled=False):
            return F.linear(x_ND.float(), self.weight.float())


def live_mean(v_N_: torch.Tensor, live_N: torch.Tensor) -> torch.Tensor:
    """The mean over the live rows of v (MoD's executed tokens under model.mod.impl=static), on the device;
    0 when none is live. torch.where, not a product: a masked row never reaches the sum, whatever it holds."""
    shape = (-1,) + (1,) * (v_N_.dim() - 1)
    total = torch.where(live_N.view(shape), v_N_, torch.zeros((), dtype=v_N_.dtype, device=v_N_.device)).sum(0)
    return total / live_N.sum().clamp_min(1).to(v_N_.dtype)


def load_balancing_loss(probs_NE: torch.Tensor, counts_E: torch.Tensor, top_k: int,
                        live_N: Optional[torch.Tensor] = None) -> torch.Tensor:
    """LB = E · Σ_e f_e · P_e, with f_e = counts_e / (N·K) (fraction of routing slots, no gradient) and
    P_e = mean_n probs_ne. Equals 1 when either f or P is uniform (the balanced minimum) and E when every
    slot and all probability go to one expert. `live_N`: only those tokens count (N = their number; `counts_E`
    are theirs), as if the others were not there."""
    N, E = probs_NE.shape
    if live_N is not None:
        f_E = counts_E.to(probs_NE.dtype) / (live_N.sum() * top_k).clamp_min(1).to(probs_NE.dtype)
        return E * (f_E * live_mean(probs_NE, live_N)).sum()
    if N == 0:
        return probs_NE.sum() * 0.0
    f_E = counts_E.to(probs_NE.dtype) / (N * top_k)
    P_E = probs_NE.mean(0)
    return E * (f_E * P_E).sum()


def sequence_balancing_loss(probs_NE: torch.Tensor, expert_NK: torch.Tensor, row_N: torch.Tensor, n_rows: int,
                            top_k: int, live_N: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The sequence-wise LB (model.moe.lb_granularity=sequence): per row b, E · Σ_e f_be · P_be over that row's
    own tokens (f_be = its slots to e / (n_b·K), P_be = its mean probability of e), averaged over the rows that
    routed any token (MoD may leave a row none). `live_N`: only those tokens count. Device ops only: no host
    read."""
    N, E = probs_NE.shape
    if N == 0:
        return probs_NE.sum() * 0.0
    ones_N = torch.ones(N, dtype=probs_NE.dtype, device=probs_NE.device)
    if live_N is not None:
        ones_N = live_N.to(probs_NE.dtype)
        probs_NE = torch.where(live_N.unsqueeze(1), probs_NE, torch.zeros((), dtype=probs_NE.dtype,
                                                                          device=probs_NE.device))
    tokens_B = probs_NE.new_zeros(n_rows).index_add_(0, row_N, ones_N)
    P_BE = probs_NE.new_zeros(n_rows, E).index_add(0, row_N, probs_NE) / tokens_B.clamp_min(1).unsqueeze(1)
    slot_S = (row_N.unsqueeze(1) * E + expert_NK).reshape(-1)
    ones_S = ones_N.unsqueeze(1).expand(N, top_k).reshape(-1)
    counts_BE = probs_NE.new_zeros(n_rows * E).index_add_(0, slot_S, ones_S).view(n_rows, E)
    f_BE = counts_BE / (tokens_B * top_k).clamp_min(1).unsqueeze(1)
    live_B = (tokens_B > 0).to(probs_NE.dtype)
    return (E * (f_BE * P_BE).sum(1) * live_B).sum() / live_B.sum().clamp_min(1)


def router_z_loss(logits_NE: torch.Tensor, live_N: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Z = mean_n (logsumexp_e logits_ne)²: keeps router logits small (ST-MoE); over the `live_N` tokens only
    when given."""
    if live_N is not None:
        return live_mean(torch.logsumexp(logits_NE, dim=-1).square(), live_N)
    if logits_NE.shape[0] == 0:
        return logits_NE.sum() * 0.0
    return torch.logsumexp(logits_NE, dim=-1).square().mean()


class SlotPlan(NamedTuple):
    """How the routing slots went to the experts (MoELayer._slots_all / _slots_live), for `_unsort`."""
    order_S: torch.Tensor  # slot order by expert
    unsort_S: torch.Tensor  # its inverse, unsort_S[order_S[s]] = s (each gather's backward is a gather by the other)
    counts_E: torch.Tensor  # the slots each expert runs (kept ones, executed ones)
    keep_S: Optional[torch.Tensor]  # with a capacity: the kept slots, in sorted order
    kept_rows: Optional[tuple]  # with a capacity: (slot_R the kept slots, row_S each slot's kept row or R)
    dropped: torch.Tensor  # slots dropped by the capacity
    valid_S1: Optional[torch.Tensor]  # static MoD: the leading executed rows; the tail is masked


def expert_capacity(factor: Optional[float], n_tokens: int, top_k: int, n_experts: int) -> Optional[int]:
    """model.moe.capacity_factor's bound: ceil(f·N·K/E) routing slots per expert (None = dropless)."""
    if factor is None:
        return None
    return max(1, math.ceil(factor * n_tokens * top_k / n_experts))


class MoELayer(nn.Module):
    """Dropless top-k MoE FFN: `forward(x_BTD) -> (y_BTD, aux_loss)`, or `(y_BTD, aux_loss, gate_scale_BT)`
    with `gate_scale_output` (the sublayer contract of nagmoe/model/residual.py).

    Parameters: `router.weight (E, D)` (role router), `w_in (E, D, H)` and `w_out (E, H, D)` (role matrix;
    `w_out` zero-initialised, so a fresh layer outputs 0 like the dense MLP). H = cfg.expert_hidden, or
    4·D / top_k (the active width of the dense MLP) when unset. Under expert parallelism the stacks hold only
    experts [first_expert, first_expert + L) (`keep_experts`).

    Auxiliary losses and micro-batches (docs/architecture.md): per forward call — one micro-batch on one
    rank — with N = B·T tokens, `aux_loss = lb_loss_weight · LB + z_loss_weight · Z` where
    `LB = E · Σ_e f_e · P_e` (f_e = fraction of the N·K routing slots that chose expert e, P_e = mean router
    probability of e over the N tokens; minimum 1 for a perfectly balanced router) and
    `Z = mean_n (logsumexp_e logits_ne)²`. The losses are statistics of this micro-batch only, nothing is
    carried across calls. The trainer divides `loss + aux_loss` by the number of micro-steps like the
    cross-entropy, so a step's aux loss is the MEAN over micro-batches of the per-micro-batch losses (not the
    loss of the concatenated batch: f·P is not linear in the batch); a distributed run averages the same
    per-(rank, micro-batch) losses over ranks, which equals one process running those micro-batches in turn.

    After each forward, `last_stats` holds detached tensors of that call: `lb_loss`, `z_loss` (0-dim fp32,
    unweighted), `tokens_per_expert` (LongTensor (E,), routing slots per expert; sums to N·K),
    `router_entropy_sum` (the router distributions' entropy summed over the N tokens, nats) and
    `router_tokens` (N): nagmoe.model.router_health reads them.
    """

    param_roles = {"w_in": MATRIX, "w_out": MATRIX}

    def __init__(self, d_model: int, cfg: MoEConfig, init_std: Optional[float] = None,
                 gate_scale_output: bool = False):
        super().__init__()
        if cfg.n_experts < 1 or not 1 <= cfg.top_k <= cfg.n_experts:
            raise UserError(f"model.moe.top_k: {cfg.top_k} must be in [1, model.moe.n_experts={cfg.n_experts}]")
        hidden = cfg.expert_hidden if cfg.expert_hidden is not None else max(1, 4 * d_model // cfg.top_k)
        if hidden < 1:
            raise UserError(f"model.moe.expert_hidden: {hidden} must be > 0")
        self.d_model, self.n_experts, self.top_k, self.hidden = d_model, cfg.n_experts, cfg.top_k, hidden
        self.lb_loss_weight, self.z_loss_weight = cfg.lb_loss_weight, cfg.z_loss_weight
        self.init_std = init_std if init_std is not None else d_model ** -0.5
        self.backend = resolve_expert_backend(cfg.impl)
        self.router = Router(d_model, cfg.n_experts)
        self.w_in = nn.Parameter(torch.empty(cfg.n_experts, d_model, hidden))
        self.w_out = nn.Parameter(torch.empty(cfg.n_experts, hidden, d_model))
        self.first_expert = 0  # global index of w_in[0] / w_out[0] (keep_experts)
        self.gate_scale_output = gate_scale_output
        self.capacity_factor = cfg.capacity_factor
        self.lb_granularity = cfg.lb_granularity
        self.balance_inputs = None  # global_batch: (P_E with its graph, counts_E) of the last forward
        self.received_rows: Optional[int] = None  # rows an expert-parallel dispatcher received in the last call
        # the same count as a 0-dim float64 device tensor, filled by the dispatcher (the forward reads this one: an
        # int attribute read inside a compiled unit is a guard on its value, a recompile whenever it changes)
        self.received_rows_stat: Optional[torch.Tensor] = None
        # loss-free balancing (model.moe.expert_bias): the (E,) selection bias, a buffer only when on (a run dir
        # saved without it must load unchanged); updated by `update_expert_bias` once per optimizer step
        self.bias_update_rate = float(cfg.bias_update_rate)
        if cfg.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.last_stats: dict[str, torch.Tensor] = {}
        self.ran: dict[str, str] = {}  # the expert path the last call took (nagmoe.train.backends_ran)
        # Token movement hook, set from outside (nagmoe.parallel): `dispatcher(layer, x_SD, counts_E) -> y_SD`
        # replaces the local expert call; an expert-parallel one also holds only this rank's slice of
        # w_in / w_out. None = all experts local. Model code stays single-device.
        self.dispatcher = None
        # the expert stacks' compute-dtype copies, recast only after a write (nagmoe/ops/cast_cache.py): a plain
        # attribute, not in the state_dict
        self.weight_casts = WeightCastCache()
        self.register_forward_pre_hook(_stage_expert_casts, with_kwargs=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.init_weights(ParamInit())

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """A fresh layer's expert bias: exactly 0 (after meta-device construction too; nagmoe/model/init_rng.py)."""
        if self.expert_bias is not None and not self.expert_bias.is_meta:
            self.expert_bias.zero_()

    @torch.no_grad()
    def update_expert_bias(self, counts_E: torch.Tensor) -> Optional[torch.Tensor]:
        """b <- b + rate·sign(mean(c) - c), then b - mean(b) (top-k ignores a constant): in place, so the buffer a
        checkpoint saves is the one the forward reads. `counts_E`: the optimizer step's routing slots per expert
        over the global batch (pre-drop choices). Returns the (E,) signs applied (the flip statistic reads
        them); None, and no change, without the bias or at rate 0 (b frozen, still applied)."""
        if self.expert_bias is None or self.bias_update_rate == 0.0:
            return None
        c_E = counts_E.to(device=self.expert_bias.device, dtype=torch.float32)
        sign_E = torch.sign(c_E.mean() - c_E)
        self.expert_bias.add_(self.bias_update_rate * sign_E)
        self.expert_bias.sub_(self.expert_bias.mean())
        return sign_E

    def select_experts(self, probs_NE: torch.Tensor) -> torch.Tensor:
        """(N, K) the chosen experts: the top-k of the router probabilities plus the expert bias when on (selection
        only, no gradient). The forward chooses through it, and so do the readers that replay a choice from the
        router's logits (the export's check, the routing probe)."""
        key_NE = probs_NE.detach() if self.expert_bias is None else probs_NE.detach() + self.expert_bias
        return key_NE.topk(self.top_k, dim=-1).indices

    def init_weights(self, init: ParamInit) -> None:
        """Router and w_in uniform with std init_std (bound sqrt(3)·std), like a linear layer reading a unit-RMS
        input; w_out zero. Seeded (nagmoe/model/init_rng.py): one generator per global expert of w_in."""
        bound = 3 ** 0.5 * self.init_std
        init.uniform_(self, "router.weight", bound)
        init.uniform_(self, "w_in", bound, first_expert=self.first_expert)
        init.zeros_(self, "w_out")

    def keep_experts(self, first: int, count: int) -> None:
        """Hold only experts [first, first + count) of the stacks (expert parallelism: the dispatcher runs the
        rest elsewhere; nagmoe.parallel.shard_experts). On a meta-device model nothing is allocated; a
        materialised one keeps a copy of its slice. The router still scores all n_experts."""
        if self.first_expert != 0 or self.w_in.shape[0] != self.n_experts:
            raise RuntimeError(f"keep_experts: the layer already holds only experts [{self.first_expert}, "
                               f"{self.first_expert + self.w_in.shape[0]})")
        if first < 0 or count < 1 or first + count > self.n_experts:
            raise ValueError(f"keep_experts: experts [{first}, {first + count}) of {self.n_experts}")
        for name in ("w_in", "w_out"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full.detach()[first:first + count].clone(),
                                             requires_grad=full.requires_grad))
        self.first_expert = first

    def extra_repr(self) -> str:
        local = "" if self.w_in.shape[0] == self.n_experts else \
            f", local_experts=[{self.first_expert}, {self.first_expert + self.w_in.shape[0]})"
        return (f"d_model={self.d_model}, n_experts={self.n_experts}, top_k={self.top_k}, hidden={self.hidden}, "
                f"backend={self.backend}{local}")

    def capacity(self, n_tokens: int) -> Optional[int]:
        """Routing slots each expert may take from a micro-batch of `n_tokens` (None = dropless)."""
        return expert_capacity(self.capacity_factor, n_tokens, self.top_k, self.n_experts)

    def run_experts(self, x_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Expert MLPs on slots sorted by expert (the seam an expert-parallel dispatcher replaces)."""
        if self.dispatcher is not None:
            return self.dispatcher(self, x_SD, counts_E)
        if not torch.compiler.is_compiling():  # what ran (run_info.json), no sync; in a graph: model.common.recording
            self.ran["experts"] = expert_path(self.backend, x_SD, self.w_in)
        # the stacks in the experts' dtype, cast once per weight write (the backends' `.to(dtype)` is then a
        # no-op); in a compiled unit the copies the pre-hook staged for this call (nagmoe/ops/cast_cache.py)
        dtype = expert_compute_dtype(x_SD)
        cast = self.weight_casts.staged if torch.compiler.is_compiling() else self.weight_casts.get
        return EXPERT_FORWARD[self.backend](x_SD, cast("w_in", self.w_in, dtype), cast("w_out", self.w_out, dtype),
                                            counts_E)

    def forward(self, x_BTD: torch.Tensor, rows: Optional[tuple] = None, select=None) -> tuple:
        """`rows` = (row_N, n_rows): each token's row when x_BTD is a flat gather of several rows (MoD's
        executed tokens as (1, N, D)); the sequence-wise balance loss reads it. Default: the B rows of x_BTD.
        `select` (a nagmoe.model.mod.Selection, model.mod.impl=static): every token is routed, but only the
        executed ones (`select.mask_BT`) take expert slots, count in the statistics and losses and get an
        output (the others' rows are 0): the same function as running the layer on the gathered executed
        tokens, with shapes that do not depend on how many execute (`_slots_live`). The decision is made here,
        in this frame (`mod.decide`): compiled, inside the unit's first graph, before the expert call may leave it."""
        select = decide(select)
        B, T, D = x_BTD.shape
        N, E, K = B * T, self.n_experts, self.top_k
        x_ND = x_BTD.reshape(N, D)
        live_N = None if select is None else select.mask_BT.reshape(N)

        # 1. route (fp32)
        logits_NE = self.router(x_ND)
        probs_NE = logits_NE.softmax(dim=-1)
        rerouted = None
        if self.expert_bias is None:
            gate_NK, expert_NK = probs_NE.topk(K, dim=-1)  # not renormalised over the k (module docstring)
        else:  # the bias moves the selection only; the gates are the unbiased probabilities of the chosen experts
            expert_NK = self.select_experts(probs_NE)
            gate_NK = probs_NE.gather(1, expert_NK)
            unbiased_NK = probs_NE.detach().topk(K, dim=-1).indices
            same_NK = (expert_NK.unsqueeze(-1) == unbiased_NK.unsqueeze(1)).any(-1)
            if live_N is None:
                rerouted = K * N - same_NK.sum()
            else:
                rerouted = K * live_N.sum() - (same_NK & live_N.unsqueeze(1)).sum()
        expert_S = expert_NK.reshape(-1)  # slot s = n·K + k
        if live_N is None:
            # routing slots per expert, on the device (bincount would read its output size on the host)
            counts_E = expert_S.new_zeros(E).index_add_(0, expert_S, torch.ones_like(expert_S))
        else:  # a skipped token's slots go to a bin E past the experts: sorted last, counted nowhere
            key_S = torch.where(live_N.unsqueeze(1).expand(N, K).reshape(-1), expert_S, E)
            counts_E = expert_S.new_zeros(E + 1).index_add_(0, key_S, torch.ones_like(key_S))[:E]

        if self.lb_granularity == "sequence":
            row_N, n_rows = rows if rows is not None else (
                torch.arange(B, device=x_BTD.device).repeat_interleave(T), B)
            lb = sequence_balancing_loss(probs_NE, expert_NK, row_N, n_rows, K, live_N)
        else:
            lb = load_balancing_loss(probs_NE, counts_E, K, live_N)
        z = router_z_loss(logits_NE, live_N)
        if self.lb_granularity == "global_batch":  # f needs every rank's counts: GlobalBalance adds the LB term
            aux_loss = self.z_loss_weight * z
            P_E = live_mean(probs_NE, live_N) if live_N is not None else (
                probs_NE.mean(0) if N else probs_NE.sum(0) * 0.0)
            self.balance_inputs = (P_E, counts_E.detach())
        else:
            aux_loss = self.lb_loss_weight * lb + self.z_loss_weight * z

        self.received_rows = self.received_rows_stat = None  # set by an expert-parallel dispatcher
        # 2. dispatch, 3. experts, undo the sort. The expert call stays in this frame: a graph break inside a
        # nested call would split the compiled unit further (nagmoe/train/speed.py, `_run_experts`)
        if live_N is None:
            x_SD, plan = self._slots_all(x_ND, expert_NK, counts_E)
        else:
            x_SD, plan = self._slots_live(x_ND, key_S, counts_E, live_N)
        y_NKD, kept_NK, dropped = self._unsort(self.run_experts(x_SD, plan.counts_E), plan)
        # 4. combine: y_ND = Σ_k gate_NK · y_NKD, in the experts' dtype, said explicitly: CUDA's autocast runs a
        # dtype-less `sum` in fp32 (CPU's does not), which made the output's dtype differ between the machines and
        # the backward an fp32 (N, K, D) temporary
        y_ND = (y_NKD * gate_NK.unsqueeze(-1).to(y_NKD.dtype)).sum(dim=1, dtype=y_NKD.dtype)

        entropy_NE = torch.special.entr(probs_NE.detach())
        self.last_stats = {"lb_loss": lb.detach(), "z_loss": z.detach(), "tokens_per_expert": counts_E.detach(),
                           "router_entropy_sum": entropy_NE.sum() if live_N is None else
                           torch.where(live_N.unsqueeze(1), entropy_NE, 0.0).sum(),
                           # a fill on the device, not a copy of a host int (a sync per layer on CUDA)
                           "router_tokens": torch.full((), N, dtype=torch.int64, device=probs_NE.device)
                           if live_N is None else live_N.sum(),
                           "dropped_slots": dropped,
                           **({"rerouted_slots": rerouted} if rerouted is not None else {}),
                           # the dispatcher's fill on the device from its host int: no copy, no read
                           **({"received_rows": self.received_rows_stat}
                              if self.received_rows_stat is not None else {})}
        if not self.gate_scale_output:
            return y_ND.view(B, T, D), aux_loss
        if kept_NK is None:
            s_N = gate_NK.sum(dim=1)  # the token's summed gate weight S (fp32)
            return y_ND.view(B, T, D), aux_loss, (s_N / s_N.detach()).view(B, T)
        # with a capacity (or MoD's skipped tokens) S sums the kept slots; a token with none kept has no update:
        # gate scale 1, no gradient
        s_N = (gate_NK * kept_NK).sum(dim=1)
        live_s_N = s_N > 0
        scale_N = torch.where(live_s_N, s_N / torch.where(live_s_N, s_N, torch.ones_like(s_N)).detach(),
                              torch.ones_like(s_N))
        return y_ND.view(B, T, D), aux_loss, scale_N.view(B, T)

    def _slots_all(self, x_ND: torch.Tensor, expert_NK: torch.Tensor, counts_E: torch.Tensor) -> tuple:
        """Step 2 for every token: (x_SD for the experts, plan). Slot s = n·K + k; slots sorted by expert
        (stable: token order within an expert). Cast to the experts' compute dtype first (bf16 under autocast):
        the slot copy and an expert-parallel payload are then N·K rows of bf16, not fp32, both ways. One gather
        from the K-expanded view: its backward writes each (n, k) once, then sums over k (no colliding
        index_add). With a capacity only the kept slots travel; the dropped ones get y = 0.
        The gather is `permute_rows`: x_SD[s] = x_ND[order_S[s] // K], backward a gather by the inverse
        permutation summed over K (no zero-filled (N, K, D) buffer, no index_put; nagmoe/ops/permute.py)."""
        N, D = x_ND.shape
        K = self.top_k
        order_S = torch.argsort(expert_NK.reshape(-1), stable=True)
        unsort_S = inverse_permutation(order_S)
        x_ND = x_ND.to(expert_compute_dtype(x_ND))
        capacity = self.capacity(N) if self.training else None
        if capacity is None:
            x_SD = permute_rows(x_ND, order_S, unsort_S, repeat=K)
            return x_SD, SlotPlan(order_S, unsort_S, counts_E, None, None, counts_E.new_zeros(()), None)
        expert_S = expert_NK.reshape(-1)[order_S]
        position_S = torch.arange(N * K, device=x_ND.device) - (counts_E.cumsum(0) - counts_E)[expert_S]
        keep_S = position_S < capacity
        kept_E = counts_E.clamp(max=capacity)
        index_S = keep_S.nonzero().squeeze(1)
        # the kept slots only, R of them: slot_R = order_S[index_S]; row_S = each slot's kept row, R if dropped
        slot_R = order_S.index_select(0, index_S)
        R = slot_R.numel()
        row_S = torch.full_like(order_S, R).scatter_(0, slot_R, torch.arange(R, device=order_S.device))
        x_RD = permute_rows(x_ND, slot_R, row_S, repeat=K, partial="out")
        return x_RD, SlotPlan(order_S, unsort_S, kept_E, keep_S, (slot_R, row_S), counts_E.sum() - kept_E.sum(),
                              None)

    def _slots_live(self, x_ND: torch.Tensor, key_S: torch.Tensor, counts_E: torch.Tensor,
                    live_N: torch.Tensor) -> tuple:
        """Step 2 with static shapes for MoD (model.mod.impl=static): every slot is sorted, the skipped tokens'
        slots (key E) last, and with a capacity the dropped ones after them, so the executed slots are the
        first rows of x_SD and the grouped GEMM's offsets stop there; the tail is masked by torch.where (never
        a product: the experts leave it unwritten, uninitialised memory, and NaN·0 = NaN), on the way in too,
        so no gradient from it reaches a token. No host read but an expert-parallel dispatcher's (it sends only
        the executed slots and returns S rows, the tail 0) or the loop backend's."""
        N, D = x_ND.shape
        K, E, S = self.top_k, self.n_experts, key_S.numel()
        kept_E, dropped = counts_E, counts_E.new_zeros(())
        if self.capacity_factor is not None and self.training:
            # expert_capacity on the device: ceil(f·n·K/E) over the n executed tokens, at least 1
            capacity = torch.ceil(self.capacity_factor * live_N.sum().double() * K / E).clamp_min(1)
            sorted_key_S, first_S = torch.sort(key_S, stable=True)
            starts_E1 = torch.cat([counts_E.cumsum(0) - counts_E, counts_E.new_zeros(1)])
            position_S = torch.arange(S, device=key_S.device) - starts_E1[sorted_key_S]
            dropped_S = (sorted_key_S < E) & (position_S >= capacity)  # a later token never displaces an earlier one
            key_S = key_S.scatter(0, first_S, torch.where(dropped_S, E, sorted_key_S))  # a permutation
            kept_E = counts_E.clamp(max=capacity.to(counts_E.dtype))
            dropped = counts_E.sum() - kept_E.sum()
        order_S = torch.argsort(key_S, stable=True)
        unsort_S = inverse_permutation(order_S)
        valid_S1 = (torch.arange(S, device=key_S.device) < kept_E.sum()).unsqueeze(1)
        x_ND = x_ND.to(expert_compute_dtype(x_ND))
        zero = torch.zeros((), dtype=x_ND.dtype, device=x_ND.device)
        x_SD = torch.where(valid_S1, permute_rows(x_ND, order_S, unsort_S, repeat=K), zero)
        # all S rows, also to an expert-parallel dispatcher: it sends only the leading Σ kept_E rows, a size it
        # reads anyway for the all-to-all's splits (issue 69: a read here would be a second sync per MoE call and
        # a graph break with a data-dependent shape in the compiled unit)
        return x_SD, SlotPlan(order_S, unsort_S, kept_E, None, None, dropped, valid_S1)

    def _unsort(self, y_SD: torch.Tensor, plan: SlotPlan) -> tuple:
        """The experts' slot outputs back in (N, K, D) token order: (y_NKD, kept_NK or None (every slot kept),
        dropped). Dropped and skipped slots are 0. Gathers both ways (`permute_rows`): y_NKD[n, k] = y_SD[unsort_S[n·K
        + k]], its backward a gather by order_S; with a capacity y_RD's kept rows straight to their slots (a
        dropped slot reads a zero row), the backward a gather by the kept slots."""
        order_S, unsort_S, _, keep_S, kept_rows, dropped, valid_S1 = plan
        S, D = order_S.numel(), y_SD.shape[-1]
        K = self.top_k
        if kept_rows is not None:  # a capacity: the kept slots' outputs into their rows
            slot_R, row_S = kept_rows
            return (permute_rows(y_SD, row_S, slot_R, partial="in").view(S // K, K, D),
                    keep_S[unsort_S].view(S // K, K), dropped)
        if valid_S1 is not None:
            if y_SD.shape[0] != S:  # the loop backend returns the executed slots only
                y_SD = torch.cat([y_SD, y_SD.new_zeros(S - y_SD.shape[0], D)])
            y_SD = torch.where(valid_S1, y_SD, torch.zeros((), dtype=y_SD.dtype, device=y_SD.device))
        kept = keep_S if valid_S1 is None else valid_S1.squeeze(1)
        return (permute_rows(y_SD, unsort_S, order_S).view(S // K, K, D),
                None if kept is None else kept[unsort_S].view(S // K, K), dropped)


def _stage_expert_casts(layer: MoELayer, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the expert stacks' casts for this call, made outside a compiled unit (which reads them
    as graph inputs; an activation-checkpoint recompute reads the same ones). Not with an expert-parallel
    dispatcher (it casts its own slices)."""
    x = args[0] if args else kwargs.get("x_BTD")
    layer.weight_casts.staged_casts = None
    if isinstance(x, torch.Tensor) and layer.dispatcher is None:
        layer.weight_casts.stage(expert_compute_dtype(x), {"w_in": layer.w_in, "w_out": layer.w_out})


class GlobalBalance:
    """The global-batch balance loss of one optimizer step (model.moe.lb_granularity=global_batch; Qwen, arXiv
    2501.11873): after each micro-step's forward, `loss(layers, reduce_fn)` sums the MoE layers' per-expert counts
    over every rank (one stacked all-reduce, `reduce_fn`), adds them to the step's running totals and returns
    Σ_l lb_loss_weight · E · Σ_e f_le · P_le with f = running counts / running slots (no gradient; a layer's slots
    are its routed tokens · K, every token filling K before any drop) and P the local micro-batch's mean
    probabilities. A fresh instance per optimizer step; forwards outside the step's micro-steps (eval, guards,
    recompute) are never passed in."""

    def __init__(self):
        self.counts_LE: Optional[torch.Tensor] = None
        self.last_f_LE: Optional[torch.Tensor] = None  # f of the last call (tests read it)

    def loss(self, layers: list, reduce_fn=None) -> Optional[torch.Tensor]:
        layers = [layer for layer in layers if layer.balance_inputs is not None]
        if not layers:
            return None
        P_LE = torch.stack([layer.balance_inputs[0].float() for layer in layers])
        counts_LE = torch.stack([layer.balance_inputs[1].to(torch.float64) for layer in layers])
        if reduce_fn is not None:  # all-reduce SUM over every rank, in place or returning the sum
            reduced = reduce_fn(counts_LE)
            counts_LE = counts_LE if reduced is None else reduced
        self.counts_LE = counts_LE if self.counts_LE is None else self.counts_LE + counts_LE
        f_LE = self.counts_LE / self.counts_LE.sum(1, keepdim=True).clamp_min(1)
        self.last_f_LE = f_LE
        for layer in layers:
            layer.balance_inputs = None  # consumed: a later forward outside the step cannot be counted
        lb_L = counts_LE.shape[1] * (f_LE.to(P_LE.dtype) * P_LE).sum(1)
        return sum(layer.lb_loss_weight * lb for layer, lb in zip(layers, lb_L))
