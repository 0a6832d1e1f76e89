"""`analyze_run(run_dir)`: depth, attention-sink, confidence and MoD readings of a checkpoint on validation
windows, as one JSON-able dict (`nagmoe analyze` writes it).

Legend: B rows, T = seq_len, V vocabulary, D width.

Windows: validation-split windows of seq_len + 1 tokens that **start at a BOS** (non-overlapping, in stored
order), so key 0 of every window is the document's BOS and the sink statistic measures attention to BOS. When
the split holds no such window (documents longer than the split's shards allow), plain packed windows are used
and the JSON says so. One forward per batch collects everything: the model's own stats (`collect_stats`), the
NAG gates' per-token gains (from each gate's modulator), the attention probabilities (pre-hooks on the attention
modules), the final decode state (the NAG log-norm), and the logits (loss, top-1, entropy).

Sections of the result: `depth` (analysis/depth.py), `attention_sink` (analysis/attention_sink.py), `confidence`
(analysis/confidence.py), `mod` and `compute_dial` (analysis/compute_dial.py; "not available" for a run trained
without MoD), `router` (nagmoe/model/router_health.py: per MoE layer entropy, max/mean load, CV, dead experts
and the load matrix), `val_loss` (nats per token) and `val_bpb`, and `notes`.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Iterable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from nagmoe.analysis.attention_sink import SinkAccumulator
from nagmoe.analysis.capture import attention_inputs_tap, decode_state, gate_modulator_tap
from nagmoe.analysis.compute_dial import DIAL_RATES, NOT_AVAILABLE, mod_section, run_dial
from nagmoe.analysis.confidence import TokenRecords, confidence_report, entropy_from_logits
from nagmoe.analysis.depth import GainAccumulator, StatsAverager, depth_report, realised_gain
from nagmoe.base.errors import UserError
from nagmoe.eval.core import LOGIT_BUDGET, inference_context
from nagmoe.model.router_health import RouterTelemetry

DEFAULT_TOKENS = 16384


# ----------------------------------------------------------------------------------------------------------
# Validation windows
# ----------------------------------------------------------------------------------------------------------
def bos_aligned_rows(shards, seq_len: int, max_windows: int) -> np.ndarray:
    """Up to `max_windows` non-overlapping (seq_len + 1)-token windows starting at BOS, in stored order."""
    rows = []
    for arr in shards.arrays:
        next_free = 0
        for p in np.flatnonzero(np.asarray(arr) == shards.bos_id):
            if len(rows) == max_windows:
                return np.stack(rows)
            if p >= next_free and p + seq_len + 1 <= len(arr):
                rows.append(np.asarray(arr[p:p + seq_len + 1], dtype=np.int64))
                next_free = p + seq_len + 1
    return np.stack(rows) if rows else np.empty((0, seq_len + 1), dtype=np.int64)


def validation_batches(data_dir: str, seq_len: int, batch_rows: int, max_tokens: int,
                       verify: bool = True) -> tuple[list, str]:
    """([(x_BT, y_BT), ...], "bos_aligned" | "packed") from the validation split."""
    from nagmoe.data.loader import TokenShards, iter_eval_batches

    shards = TokenShards(data_dir, "val", verify=verify)
    n = max(1, max_tokens // seq_len)
    rows = bos_aligned_rows(shards, seq_len, n)
    if len(rows) == 0:
        return list(iter_eval_batches(shards, seq_len, batch_rows, max_tokens=max_tokens)), "packed"
    t = torch.from_numpy(rows)
    return [(t[i:i + batch_rows, :-1].contiguous(), t[i:i + batch_rows, 1:].contiguous())
            for i in range(0, len(rows), batch_rows)], "bos_aligned"


def split_batches(batches: list, tokens: int) -> tuple[list, list]:
    """(the first batches holding up to `tokens` tokens (at least one batch), the rest)."""
    head, seen = [], 0
    for i, (x, _) in enumerate(batches):
        if head and seen + x.numel() > tokens:
            return head, batches[i:]
        head.append((x, _))
        seen += x.numel()
    return head, []


# ----------------------------------------------------------------------------------------------------------
# One measuring pass
# ----------------------------------------------------------------------------------------------------------
class Measurements:
    def __init__(self, n_layers: int):
        self.stats = StatsAverager()
        self.gains = GainAccumulator(2 * n_layers)
        self.sink = SinkAccumulator(n_layers)
        self.tokens = TokenRecords()
        self.router = RouterTelemetry()
        self.nats, self.n_tokens, self.bytes_nats, self.n_bytes = 0.0, 0, 0.0, 0


@torch.no_grad()
def measure(model, batches: Iterable, device, bos_id: Optional[int] = None,
            token_bytes_V: Optional[torch.Tensor] = None, detailed: bool = True) -> Measurements:
    """Run the batches once; `detailed=False` keeps only loss, bpb and the model's stats (the dial's pass)."""
    nag = model.config.residual == "nag"
    m = Measurements(len(model.blocks))
    is_bos: dict = {}

    def on_attention(layer, module, x_BTD, select):
        m.sink.add(layer, module, x_BTD, is_bos.get("BT"), select.mask_BT if select is not None else None)

    def on_modulator(index, m_BT):
        m.gains.add(index, realised_gain(model, index, m_BT))

    was_training = model.training
    model.eval()
    try:
        for x_BT, y_BT in batches:
            x_BT, y_BT = x_BT.to(device), y_BT.to(device)
            is_bos["BT"] = (x_BT == bos_id) if bos_id is not None else None
            with contextlib.ExitStack() as taps:
                if detailed:
                    taps.enter_context(attention_inputs_tap(model, on_attention))
                    if nag:
                        taps.enter_context(gate_modulator_tap(model, on_modulator))
                decoded = taps.enter_context(decode_state(model))
                taps.enter_context(inference_context(device))
                out = model(x_BT, collect_stats=True)
            logits_BTV = out.logits.float()
            loss_BT = F.cross_entropy(logits_BTV.flatten(0, 1), y_BT.flatten(), reduction="none").view_as(y_BT)
            m.stats.add(out.stats, y_BT.numel())
            m.router.add(model)
            m.nats += float(loss_BT.sum())
            m.n_tokens += y_BT.numel()
            if token_bytes_V is not None:
                nbytes_BT = token_bytes_V.to(device)[y_BT]
                m.bytes_nats += float(loss_BT[nbytes_BT > 0].sum())
                m.n_bytes += int(nbytes_BT.sum())
            if detailed:
                records = {"loss": loss_BT, "correct": logits_BTV.argmax(-1) == y_BT,
                           "entropy": entropy_from_logits(logits_BTV)}
                if nag:
                    records["final_log_norm"] = decoded.last.log_norm_BT
                m.tokens.add(**records)
    finally:
        model.train(was_training)
    return m


def _loss_bpb(m: Measurements) -> tuple[float, Optional[float]]:
    loss = m.nats / m.n_tokens if m.n_tokens else float("nan")
    bpb = m.bytes_nats / (math.log(2) * m.n_bytes) if m.n_bytes else None
    return loss, bpb


# ----------------------------------------------------------------------------------------------------------
# The whole analysis
# ----------------------------------------------------------------------------------------------------------
def analyze_model(model, batches: list, device="cpu", bos_id: Optional[int] = None,
                  token_bytes_V: Optional[torch.Tensor] = None, seq_len: Optional[int] = None, n_bins: int = 10,
                  dial_rates: Iterable[float] = DIAL_RATES, calibration_batches: Optional[list] = None) -> dict:
    """All sections for `model` on `batches` of (x_BT, y_BT). The compute dial calibrates each rate on
    `calibration_batches` (tokens disjoint from `batches`) when given, then measures on `batches`."""
    cfg = model.config
    nag = cfg.residual == "nag"
    seq_len = seq_len or batches[0][0].shape[1]
    m = measure(model, batches, device, bos_id, token_bytes_V)
    stats = m.stats.mean()
    loss, bpb = _loss_bpb(m)
    notes = []
    loss_t, correct_t = m.tokens.get("loss"), m.tokens.get("correct")
    confidence = {"entropy": confidence_report(m.tokens.get("entropy"), loss_t, correct_t, n_bins)}
    if nag:
        confidence["final_log_norm"] = confidence_report(m.tokens.get("final_log_norm"), loss_t, correct_t, n_bins)
    result = {
        "residual": cfg.residual, "attention": cfg.attention.kind, "ffn": cfg.ffn, "n_layers": cfg.n_layers,
        "n_sublayers": 2 * cfg.n_layers, "seq_len": seq_len, "tokens": m.n_tokens,
        "val_loss": loss, "val_bpb": bpb,
        "depth": depth_report(stats, cfg.residual, m.gains if nag else None),
        "attention_sink": m.sink.report(),
        "confidence": confidence,
        "mod": mod_section(stats, model),
        "router": (m.router.report() if not m.router.empty
                   else "not applicable (dense FFN: no router)"),
    }
    if not nag:
        result["compute_dial"] = "not applicable (pre-norm run: no rotation score)"
    else:
        def evaluate():
            md = measure(model, batches, device, bos_id, token_bytes_V, detailed=False)
            return (*_loss_bpb(md), md.stats.mean())

        def calibrate_forwards():
            measure(model, calibration_batches, device, bos_id, token_bytes_V, detailed=False)

        result["compute_dial"] = run_dial(model, seq_len, evaluate, dial_rates,
                                          calibrate_forwards if calibration_batches else None)
    if result["mod"] == NOT_AVAILABLE:
        notes.append("mod: this model was trained without MoD (model.mod.skip_rate=0): no skip rates, no dial")
    result["notes"] = notes
    return result


def analysis_rows(cfg, batch_rows: int) -> int:
    """Windows per forward: at most `batch_rows`, fewer when their logits would exceed LOGIT_BUDGET."""
    return max(1, min(batch_rows, LOGIT_BUDGET // (cfg.data.seq_len * cfg.model.vocab_size)))


def analyze_run(run_dir: str, device: str = "cpu", max_tokens: int = DEFAULT_TOKENS, batch_rows: int = 8,
                n_bins: int = 10) -> dict:
    """Load the run's latest valid checkpoint and analyse it on its validation split."""
    from nagmoe.data.bpb import token_bytes
    from nagmoe.eval.generate import load_run

    if max_tokens < 1 or batch_rows < 1 or n_bins < 1:
        raise UserError(f"--tokens {max_tokens}, --batch-rows {batch_rows} and --bins {n_bins} must be >= 1")
    run = load_run(run_dir, device)
    cfg = run.config
    seq_len = cfg.data.seq_len
    rows = analysis_rows(cfg, batch_rows)
    # twice the tokens: the first half analysed, the rest calibrates the compute dial (disjoint tokens)
    both, windows = validation_batches(cfg.data.data_dir, seq_len, rows, 2 * max_tokens, cfg.data.verify_shards)
    batches, calibration = split_batches(both, max_tokens)
    result = analyze_model(run.model, batches, device, run.bos_id, token_bytes(cfg.data.data_dir), seq_len, n_bins,
                           calibration_batches=calibration or batches)
    result = {"run_dir": os.path.abspath(run_dir), "checkpoint": run.checkpoint, "windows": windows, **result}
    if windows != "bos_aligned":
        result["notes"].append("windows: no BOS-aligned validation window fits; key 0 is not a BOS")
    if not calibration and run.model.mod_calibrator() is not None:
        result["notes"].append("compute_dial: calibrated on the analysed tokens (the validation split holds no "
                               "more): its realised rates are in-sample")
    return result


def analyze_milestones(run_dir: str, device: str = "cpu", max_tokens: int = DEFAULT_TOKENS,
                       batch_rows: int = 8) -> list:
    """Norm, rotation, skip and router health through training (issue 27): the milestones
    (`train.keep_milestone_every_tokens`, never pruned: weights-only under milestones/, or full checkpoints marked
    as milestones) and the latest checkpoint, each measured on the same validation windows; oldest first, one row
    a step (where a milestone and the latest checkpoint share one, the checkpoint: the state in full precision)."""
    from nagmoe.checkpoint import list_milestones, load_model_weights
    from nagmoe.checkpoint.files import read_checkpoint_state
    from nagmoe.data.bpb import token_bytes
    from nagmoe.eval.generate import load_run

    run = load_run(run_dir, device)
    cfg = run.config
    rows = analysis_rows(cfg, batch_rows)
    batches, _ = validation_batches(cfg.data.data_dir, cfg.data.seq_len, rows, max_tokens, cfg.data.verify_shards)
    tb = token_bytes(cfg.data.data_dir)
    points = {step: (path, True) for step, path in list_milestones(run_dir)}
    latest_step = read_checkpoint_state(run.checkpoint)["step"]
    points[latest_step] = (run.checkpoint, latest_step in points)
    series = []
    for step, (path, milestone) in sorted(points.items()):
        load_model_weights(path, run.model)  # verifies the manifest first; any format (nagmoe.checkpoint.reader)
        tokens = read_checkpoint_state(path).get("extra", {}).get("progress", {}).get("tokens")
        m = measure(run.model, batches, device, run.bos_id, tb, detailed=False)
        stats = m.stats.mean()
        loss, bpb = _loss_bpb(m)
        depth = depth_report(stats, cfg.model.residual)
        mod = mod_section(stats, run.model)
        router = None if m.router.empty else m.router.report()
        series.append({
            "step": step, "tokens": tokens, "milestone": milestone, "checkpoint": path, "val_loss": loss,
            "val_bpb": bpb, "norm_growth": depth["norm_growth"],
            "cumulative_rotation": depth["cumulative_rotation"][-1],
            "skip_rate": mod["realised_skip_rate"] if isinstance(mod, dict) else None,
            "router_max_over_mean": max(router["max_over_mean"]) if router else None,
            "router_dead_experts": sum(router["dead"]) if router else None})
    return series
