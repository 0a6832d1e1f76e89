"""The language model: embed -> blocks (attention sublayer, FFN sublayer) -> decode.

Legend: B batch, T sequence, D model width, V vocabulary.

The residual stream (`model.residual`), the attention (`model.attention.kind`) and the FFN (`model.ffn`) are
picked by name; the block loop is the same for all of them (see residual.py). Block i holds sublayer
indices 2i (attention, NAG l = 2i+1) and 2i+1 (FFN, NAG l = 2i+2).

Incremental decoding: `cache = model.new_cache(max_len)` then `model(idx_BT, cache=cache)` runs the T tokens
that follow the `cache.position` tokens already consumed (prefill: the whole prompt; decode: one token per
call) and returns their logits; each block's attention keeps its `AttentionCache` (KV, and CCA's conv and
value-shift state). Everything else in the stack is per token, so both residual streams decode unchanged.
Prefill + one-token steps equal the full forward (tests/model/test_kv_cache.py). Use under torch.no_grad().

Mixture-of-Depths (NAG, `model.mod.skip_rate > 0`; nagmoe/model/mod.py): the stream decides per sublayer
which tokens execute; the FFN/MoE is handed over wrapped in `mod.run_on_executed` (a flat gather of the
executed tokens), the attention takes the selection itself (K/V for every token, queries for the executed).
`mod_update(reduce_fn)` after each optimizer step sets the next step's thresholds from this step's scores
and returns the realised executed fraction per sublayer; `set_mod_skip_rate(rate)` is the compute dial.

Init (nanochat-like): embedding N(0, 1); input projections uniform with std `model.init_std` (default
d^-0.5); output projections (c_proj, expert w_out) zero; unembedding std from the residual stream (0.001
for pre-norm; d^-0.5 for NAG, whose rows are renormalised in the forward anyway). `build_model` constructs
on the meta device and draws each parameter (each expert) from its own generator seeded by (seed, name,
global expert), so every expert-parallel layout and device gets the same weights (nagmoe/model/init_rng.py).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from nagmoe.base.errors import UserError
from nagmoe.model.attention import AttentionCache, build_attention
from nagmoe.model.common import recording
from nagmoe.model.init_rng import ParamInit, init_model
from nagmoe.model.mlp import DenseMLP
from nagmoe.model.mod import run_on_executed
from nagmoe.model.mod_calibration import SkipRateUnavailable
from nagmoe.model.residual import PRECISIONS, build_residual_stream
from nagmoe.model.roles import UNEMBEDDING
from nagmoe.model.stats import StatsCollector
from nagmoe.ops.loss import IGNORE_INDEX, chunk_cross_entropy, run_chunk  # IGNORE_INDEX: targets < 0 not scored

# `uniform` precision computes logits and loss in chunks of at most this many fp32 logits (256 MB: 2048 tokens
# at V = 32768), each recomputed in the backward, so the (B, T, V) fp32 logits never exist at once (unless the
# memory estimate says they fit: Transformer.loss_recompute, nagmoe.train.memory.plan_loss_recompute)
LOSS_CHUNK_ELEMENTS = 2 ** 26


class ModelOutput(NamedTuple):
    logits: Optional[torch.Tensor]  # (B, T, V) fp32, only when no targets were given
    loss: Optional[torch.Tensor]  # fp32 cross-entropy; (B, T) with reduction="none"
    aux_loss: torch.Tensor  # 0-dim: sum of the (already weighted) MoE auxiliary losses; 0. for dense
    stats: Optional[dict]  # residual-stream statistics (stats.py) when collected, else None


class InferenceCache:
    """Decoding state of a whole model for a batch of sequences: one `AttentionCache` per block."""

    def __init__(self, n_layers: int, max_len: int):
        self.max_len = max_len
        self.layers = [AttentionCache(max_len) for _ in range(n_layers)]

    @property
    def position(self) -> int:
        """Tokens consumed so far (the position of the next token)."""
        return self.layers[0].length

    def kv_bytes_per_token(self) -> int:
        return sum(layer.kv_bytes_per_token() for layer in self.layers)

    def state_bytes(self) -> int:
        return sum(layer.state_bytes() for layer in self.layers)


class Unembedding(nn.Linear):
    """The untied output head `lm_head: Linear(d, V, bias=False)`, with its own optimizer role."""

    param_roles = {"weight": UNEMBEDDING}


def build_ffn(model_cfg, init_std: Optional[float]) -> nn.Module:
    if model_cfg.ffn == "moe":
        from nagmoe.model.moe import MoELayer  # lazy: only MoE configs need it

        gate_scale = model_cfg.residual == "nag" and model_cfg.moe.gate_grad == "step_gain"
        return MoELayer(model_cfg.d_model, model_cfg.moe, init_std=init_std, gate_scale_output=gate_scale)
    return DenseMLP(model_cfg.d_model, model_cfg.mlp_hidden, init_std)


class Block(nn.Module):
    def __init__(self, model_cfg):
        super().__init__()
        self.attn = build_attention(model_cfg.d_model, model_cfg.attention, model_cfg.init_std)
        self.ffn = build_ffn(model_cfg, model_cfg.init_std)


class Transformer(nn.Module):
    def __init__(self, model_cfg):
        super().__init__()
        self.config = model_cfg
        # _weight: skip nn.Embedding's own N(0, 1) draw (reset_parameters below makes it); on the meta device that
        # draw alone would import torch._dynamo (seconds) in every process that builds a model
        self.wte = nn.Embedding(model_cfg.vocab_size, model_cfg.d_model,
                                _weight=torch.empty(model_cfg.vocab_size, model_cfg.d_model))
        self.blocks = nn.ModuleList(Block(model_cfg) for _ in range(model_cfg.n_layers))
        self.lm_head = Unembedding(model_cfg.d_model, model_cfg.vocab_size, bias=False)
        self.stream = build_residual_stream(model_cfg, 2 * model_cfg.n_layers)
        # Statistics are off unless asked for (this attribute, or forward's argument).
        self.collect_stats = False
        self.precision = "uniform"  # set_precision (train.precision)
        self.loss_chunk_tokens: Optional[int] = None  # None: LOSS_CHUNK_ELEMENTS // vocab_size
        # the loss chunk's function (nagmoe/ops/loss.py): the compiled one when compile_model attached it
        self.loss_chunk: Callable = chunk_cross_entropy
        # recompute each chunk's logits in the backward (True) or keep them: the memory estimate's choice
        # (nagmoe.train.memory.plan_loss_recompute), equal results either way
        self.loss_recompute = True
        self.ran: dict[str, str] = {}  # the loss path the last call took (nagmoe.train.backends_ran)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise the tables; sublayers and gates initialise themselves on construction."""
        self.init_weights(ParamInit())

    def init_weights(self, init: ParamInit) -> None:
        init.normal_(self, "wte.weight", 1.0)
        init.normal_(self, "lm_head.weight", self.stream.head_init_std())

    def sublayers(self):
        """The sublayers in stream order: block 0 attention, block 0 FFN, block 1 attention, ..."""
        for block in self.blocks:
            yield block.attn
            yield block.ffn

    def set_precision(self, policy: str) -> None:
        """`train.precision` (docs/architecture.md): `uniform` (fp32 carrier in both streams, every matmul but
        the router's in the autocast dtype, chunked logits and loss) or `legacy` (the numerics of run dirs
        from before the key: NAG's direction in the compute dtype, its decode in fp32, full logits)."""
        if policy not in PRECISIONS:
            raise UserError(f"train.precision: {policy!r} is not one of {', '.join(PRECISIONS)}")
        self.precision = self.stream.precision = policy

    def set_injection_warmup(self, factor: float) -> None:
        """NAG injection warm-up factor in [0, 1] (the trainer sets min(1, tokens / model.nag.warmup_tokens));
        the gate scale is alpha·m·factor. A no-op for the pre-norm stream."""
        if not 0.0 <= factor <= 1.0:
            raise ValueError(f"injection warm-up factor must be in [0, 1], got {factor}")
        self.stream.set_injection_warmup(factor)

    # ------------------------------------------------------------------------------------------------------
    # Mixture-of-Depths
    # ------------------------------------------------------------------------------------------------------
    def mod_calibrator(self):
        """The stream's MoDCalibrator, or None without MoD."""
        return getattr(self.stream, "mod", None)

    def mod_update(self, reduce_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Optional[list]:
        """Call after each optimizer step. Folds this step's rotation-score histograms (summed over ranks by
        `reduce_fn`, an in-place or returning all-reduce SUM of a float64 tensor; None for one process) into
        the thresholds of the NEXT step, and returns the realised executed fraction per sublayer (2·n_layers,
        1.0 where nothing skipped) of the step just taken. None without MoD."""
        mod = self.mod_calibrator()
        return None if mod is None else mod.update(reduce_fn)

    def mod_summary(self) -> dict:
        """The run so far: `skip_rate` (realised, mean over eligible sublayers, 0. without MoD) and
        `executed_fractions` (token-weighted per sublayer over every step; None without MoD)."""
        mod = self.mod_calibrator()
        if mod is None:
            return {"skip_rate": 0.0, "executed_fractions": None}
        fractions = mod.run_executed_fractions()
        return {"skip_rate": mod.skip_rate_of(fractions), "executed_fractions": fractions}

    def set_mod_seq_len(self, seq_len: int) -> None:
        """MoD's work weights at the sequence length the run trains at (data.seq_len; the attention scores'
        share of a sublayer's work grows with it). No-op without MoD."""
        mod = self.mod_calibrator()
        if mod is not None:
            from nagmoe.config.flops import skippable_flops_per_sublayer

            mod.set_work_weights(skippable_flops_per_sublayer(self.config, seq_len))

    def set_mod_skip_rate(self, rate: float, level=None) -> None:
        """The post-training compute dial: thresholds for another skip rate from the saved score histograms
        (`level`: the histogram level to read them at, default `rate`; model/mod_calibration.py's
        calibrate_skip_rate calibrates it so that the realised rate is `rate`)."""
        mod = self.mod_calibrator()
        if mod is None:
            raise SkipRateUnavailable("this model was trained without MoD (model.mod.skip_rate=0): it has no base "
                                      "vectors or score histograms")
        mod.set_skip_rate(rate, level)

    def update_expert_bias(self, counts_LE: torch.Tensor) -> Optional[torch.Tensor]:
        """Loss-free balancing (model.moe.expert_bias): each MoE layer's bias from the optimizer step's routing
        slots per expert over the global batch (`counts_LE`, MoE layers in depth order, as the trainer's router
        telemetry sums them). The trainer calls it once per taken step (the routing probe, once per router step;
        nothing else does). Returns the (L, E) signs applied, or None when no bias moved (off, or rate 0)."""
        from nagmoe.model.router_health import moe_layers

        layers = moe_layers(self)
        if counts_LE.shape[0] != len(layers):
            raise ValueError(f"update_expert_bias: {counts_LE.shape[0]} rows of counts for {len(layers)} MoE layers")
        signs = [layer.update_expert_bias(counts_E) for layer, counts_E in zip(layers, counts_LE)]
        return torch.stack(signs) if signs and all(s is not None for s in signs) else None

    def new_cache(self, max_len: Optional[int] = None) -> InferenceCache:
        """An empty decoding state for up to `max_len` positions (default model.max_seq_len)."""
        return InferenceCache(len(self.blocks), max_len or self.config.max_seq_len)

    def forward(self, idx_BT: torch.Tensor, targets_BT: Optional[torch.Tensor] = None, reduction: str = "mean",
                collect_stats: Optional[bool] = None, cache: Optional[InferenceCache] = None,
                decode: bool = True) -> ModelOutput:
        """`decode=False` stops after the blocks (no logits, no loss): the statistics of the residual stream without
        a (B, T, V) tensor (the gate-collapse check reads only the sublayers' gains)."""
        want_stats = self.collect_stats if collect_stats is None else collect_stats
        stats = StatsCollector() if want_stats else None
        state = self.stream.encode(self.wte, idx_BT, stats)
        aux_loss = torch.zeros((), dtype=torch.float32, device=idx_BT.device)
        mod = self.mod_calibrator()
        for index, sublayer in enumerate(self.sublayers()):
            if cache is not None and index % 2 == 0:  # attention sublayer of block index // 2
                sublayer = functools.partial(sublayer, cache=cache.layers[index // 2])
            elif mod is not None and index % 2 == 1:  # FFN/MoE: on the gathered executed tokens
                sublayer = functools.partial(run_on_executed, sublayer)
            state, aux = self.stream.apply(index, sublayer, state, stats)
            if aux is not None:
                aux_loss = aux_loss + aux
        if not decode:
            return ModelOutput(None, None, aux_loss, stats.as_dict() if stats is not None else None)
        if targets_BT is not None and self.precision == "uniform" and stats is None:
            loss = chunked_loss(self.stream, state, self.lm_head, targets_BT, reduction,
                                self.loss_chunk_tokens or max(1, LOSS_CHUNK_ELEMENTS // self.config.vocab_size),
                                self.loss_chunk, self.loss_recompute)
            ran = recording(self.ran)
            if ran is not None:
                ran["loss"] = ("eager" if self.loss_chunk is chunk_cross_entropy else "compiled") + (
                    ", chunks recomputed" if self.loss_recompute else ", logits kept")
            return ModelOutput(None, loss, aux_loss, None)
        logits_BTV = self.stream.decode(state, self.lm_head, stats)
        loss = None
        if targets_BT is not None:
            loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), targets_BT.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction=reduction)
            if reduction == "none":
                loss = loss.view_as(targets_BT)
            logits_BTV = None
        return ModelOutput(logits_BTV, loss, aux_loss, stats.as_dict() if stats is not None else None)


def _token_rows(state, lo: int, hi: int):
    """Tokens [lo, hi) of the flattened (B·T) state as a (1, hi - lo, ...) state (a tensor or a tuple of them)."""
    if isinstance(state, torch.Tensor):
        return state.reshape(1, -1, *state.shape[2:])[:, lo:hi]
    return type(state)(*(t.reshape(1, -1, *t.shape[2:])[:, lo:hi] for t in state))


def chunked_loss(stream, state, lm_head: nn.Module, targets_BT: torch.Tensor, reduction: str,
                 chunk_tokens: int, chunk_fn: Callable = chunk_cross_entropy, recompute: bool = True) -> torch.Tensor:
    """Cross-entropy of the decoded state, `chunk_tokens` tokens at a time: each chunk's logits are made and
    scored by `chunk_fn` (nagmoe/ops/loss.py: the eager chunk, or the compiled one, one region); with `recompute`
    they are dropped and remade in the backward (activation checkpointing), so at most one chunk's fp32 logits
    exist, else each chunk keeps what its backward needs (the memory estimate's choice: no second decode
    matmul). Equal to the full computation: the sum over chunks / the count of scored targets ("mean"), or the
    per-token losses ("none"); recompute or not, the same values (the recompute reruns the same function)."""
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    B, T = targets_BT.shape
    N = B * T
    w_VD = stream.decode_weight(lm_head)  # once, not per chunk
    y_N = targets_BT.reshape(N)
    chunk_reduction = "none" if reduction == "none" else "sum"

    parts = []
    for lo in range(0, N, chunk_tokens):
        hi = min(N, lo + chunk_tokens)
        rows = _token_rows(state, lo, hi)
        if chunk_tokens >= N or not recompute:  # one chunk: nothing to save by recomputing
            parts.append(run_chunk(chunk_fn, stream, rows, w_VD, y_N[lo:hi], chunk_reduction))
        else:
            parts.append(torch.utils.checkpoint.checkpoint(run_chunk, chunk_fn, stream, rows, w_VD, y_N[lo:hi],
                                                           chunk_reduction, use_reentrant=False))
    if reduction == "none":
        return torch.cat(parts).view(B, T)
    return torch.stack(parts).sum() / (y_N != IGNORE_INDEX).sum()


def build_model(model_cfg, seed: Optional[int] = None, device=None) -> Transformer:
    """The model for `config.model` (already validated by nagmoe.config), every parameter drawn from its
    (seed, name, expert) generator (nagmoe/model/init_rng.py). `seed` defaults to `torch.initial_seed()`, the
    seed of the last `torch.manual_seed`, so `torch.manual_seed(s); build_model(m)` is the model a run with
    `train.seed=s` starts from. `device` defaults to torch's default device; on the meta device (`with
    torch.device("meta"): build_model(m)`) only the structure is built, for `shard_experts` + `init_model`
    to materialise what one rank holds."""
    device = torch.get_default_device() if device is None else torch.device(device)
    with torch.device("meta"):
        model = Transformer(model_cfg)
    if device.type == "meta":
        return model
    return init_model(model, torch.initial_seed() if seed is None else seed, device)
