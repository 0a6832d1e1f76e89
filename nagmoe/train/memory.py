"""Memory per rank of a training layout, before anything is queued (issue 25): the one estimator behind
`nagmoe params --memory`, `nagmoe launch slurm --dry-run` (warns when a layout does not fit --gpu-memory) and
the GPU-ready step.

Parts, in bytes per rank (N = tokens of one micro-batch on the rank, P = parallel.ep, L = E/P local experts):
  parameters        fp32 master weights: every replicated parameter + 1/P of every expert stack
  gradients         the same again (fp32)
  ddp_buckets       DDP's flat bucket copy of the replicated gradients (world size > 1; not a bucket view)
  optimizer         by role: Muon keeps one momentum per matrix, AdamW two moments (train.optimizer=adamw:
                    every role AdamW); `optimizer_workspace`: Newton-Schulz temporaries, ~4 copies of the largest
                    matrix in its dtype (bf16 on CUDA, fp32 on CPU)
  activations       what autograd saves for the backward of one micro-batch, *measured* on the real widths: a
                    1-block and a 2-block copy of the model (same width, experts, vocabulary, residual,
                    attention, activation checkpointing) run forward on 64 and on 128 tokens under
                    `saved_tensors_hooks` (CUDA mode: CPU autocast bf16 under CUDA's autocast rules of the target
                    torch, nagmoe/cuda_rules: which ops run in bf16 and which in fp32 is CUDA's, e.g. the sum
                    family fp32, `rms_norm` fp32 from torch 2.12; NAG lanes, logits and loss fp32 as in the
                    model; `layout.cuda_rules` names the version). The two token counts separate bytes per
                    token from bytes per forward (autocast's bf16 weight copies); the two depths separate a
                    block from the embedding/decode/loss part; scaled to n_layers and the micro-batch's
                    tokens. Attention is counted as linear in the sequence (flash/efficient SDPA save the
                    log-sum-exp, not the T x T matrix; `model.attention.impl=math` would save more). Eager and
                    full depth (MoD skipping and torch.compile only lower it: an upper bound for both).
  backward_transient  the fp32 logits' gradient and the loss's (2 x N x vocab x 4 bytes), the largest tensors the
                    backward creates at once; with train.precision uniform the loss runs in chunks (at most
                    LOSS_CHUNK_ELEMENTS logits each, recomputed in the backward): 3 x chunk x vocab x 4
  loss_logits_kept  (inside `activations`) the chunks' fp32 logits kept for the backward when the loss does not
                    recompute them (`loss_recompute=False`): N x vocab x 4; 0 when it recomputes. The trainer
                    keeps them where the estimate with them fits the device (`plan_loss_recompute`)
  receive_worst     expert parallelism: dropless, one rank may receive every slot of all P sources (P·N·K rows
                    of x, the two hidden activations and y); with model.moe.capacity_factor f at most
                    P·L·ceil(f·N·K/E) rows. The balanced case (N·K rows) is inside `activations` already.
  runtime           CUDA context and NCCL (~1 GiB, typical) on cuda; on cpu the process baseline (Python, torch
                    and nagmoe imported; measured below)
"""
from __future__ import annotations

import contextlib
import copy
import gc
import os
import sys
from typing import Optional

import torch

from nagmoe.model.moe import expert_capacity
from nagmoe.config.schema import expert_hidden

GIB = 2 ** 30
CUDA_RUNTIME_BYTES = 1 * GIB  # CUDA context + NCCL communicators and buffers, typical for one H100 rank
# RSS of `python -c "import torch, nagmoe.train.trainer"` on the 2-core CPU VM (2026-12-01): 0.43 GB
CPU_PROCESS_BYTES = 430 * 2 ** 20
NS_COPIES = 4  # Newton-Schulz holds X, X Xᵀ, its square and the update of the largest matrix at once


def _meta_model(model_cfg):
    from nagmoe.model import build_model

    with torch.device("meta"):
        return build_model(model_cfg)


def parameter_bytes(model_cfg, ep: int, optimizer: str, device: str) -> dict:
    """Parameters, gradients, optimizer states by role and the Newton-Schulz workspace of one rank."""
    from nagmoe.model.roles import MATRIX, param_roles

    model = _meta_model(model_cfg)
    roles = param_roles(model)
    expert = {n for n, _ in model.named_parameters() if n.endswith((".w_in", ".w_out"))}
    rank_numel, replicated, by_role, largest = 0, 0, {}, 0
    for name, p in model.named_parameters():
        numel = p.numel() // ep if name in expert else p.numel()
        rank_numel += numel
        replicated += 0 if name in expert else numel
        role = roles[name]
        muon = optimizer == "muon" and role == MATRIX
        by_role[role] = by_role.get(role, 0) + numel * 4 * (1 if muon else 2)
        if muon:
            largest = max(largest, p.shape[-2] * p.shape[-1])
    ns_bytes = 2 if device == "cuda" else 4
    return {"parameters": rank_numel * 4, "gradients": rank_numel * 4, "replicated_bytes": replicated * 4,
            "optimizer": sum(by_role.values()), "optimizer_by_role": by_role,
            "optimizer_workspace": NS_COPIES * largest * ns_bytes}


def estimate_rules(device: str, rules: Optional[str] = None) -> Optional[str]:
    """The torch version whose CUDA autocast rules the activation probes run under, or None (fp32, no autocast).
    cuda: `rules` if given, else NAGMOE_CUDA_RULES, else the installed torch's when nagmoe has its table, else
    the newest table (the cluster's torch is the one that matters: pass it). cpu: NAGMOE_CUDA_RULES (a CPU run
    under CUDA's rules trains in bf16), else None."""
    from nagmoe.cuda_rules.table import KNOWN_VERSIONS, rules_for, version_key
    from nagmoe.cuda_rules.tier import rules_from_env

    if device == "cpu":
        return rules_from_env()
    if rules is not None:
        rules_for(rules)  # an unknown version is a UserError naming the known ones
        return version_key(rules)
    chosen = rules_from_env()
    if chosen is None:
        installed = version_key(torch.__version__)
        chosen = installed if installed in KNOWN_VERSIONS else KNOWN_VERSIONS[-1]
    return chosen


def _rules_scope(rules: Optional[str]):
    """CUDA's rules of torch `rules` registered (the trainer keeps them for the whole step: the backward's
    activation-checkpoint recompute meets them too); nothing when None."""
    from nagmoe.cuda_rules.tier import CudaAutocastRules

    return CudaAutocastRules(rules) if rules else contextlib.nullcontext()


def _autocast(rules: Optional[str]):
    """The forward's region: CPU bf16 autocast (under the registered rules), or fp32."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=rules is not None)


def _saved_bytes(model, idx_BT, rules: Optional[str]) -> int:
    """Bytes autograd saves for one forward of `model` on `idx_BT`, each storage once (views share it). A saved
    parameter (a matmul's weight, fp32 without autocast) is not an activation: `parameters` counts it, and the
    probe model holds every expert, a rank only its share."""
    seen = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        try:
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            key, size = id(t), t.numel() * t.element_size()
        if key not in params:
            seen[key] = size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _rules_scope(rules), _autocast(rules):
        out = model(idx_BT, idx_BT)
        del out
    return sum(seen.values())


@contextlib.contextmanager
def _quiet_stderr():
    """The CPU profiler prints its start and stop lines to fd 2 from C++: keep them out of the CLI's output."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _peak_bytes(model, idx_BT, rules: Optional[str]) -> int:
    """Peak of the bytes allocated during one forward + backward of `model` on `idx_BT` (the CPU allocator's
    events under the profiler): saved activations plus what the ops hold at once (temporaries, the backward's
    activation gradients). Gradients exist beforehand (zeros, as after the first micro-step), so accumulating
    into them counts only the new gradient each accumulation makes."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    # Python's collector, when it runs inside the profiled window, frees cyclic garbage made there earlier than
    # otherwise: the peak moved by a few bytes from one call to the next (a flaky CI test). Collect first, pause it
    # inside, as the trainer does during its steps (nagmoe/train/gc_control.py).
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        peak = _profiled_peak(model, idx_BT, rules)
    finally:
        if was_enabled:
            gc.enable()
    model.zero_grad(set_to_none=True)
    return peak


def _profiled_peak(model, idx_BT, rules: Optional[str]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with _rules_scope(rules):
            with _autocast(rules):
                out = model(idx_BT, idx_BT)
            (out.loss + out.aux_loss).backward()
        del out
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


PROBE_TOKENS = (64, 128)


def activation_bytes(model_cfg, tokens: int, rules: Optional[str], checkpointing: bool = False,
                     precision: str = "legacy") -> dict:
    """Saved activations of one micro-batch of `tokens` tokens (module docstring: measured on 1- and 2-block
    copies at the real widths, at two token counts) under CUDA's autocast rules of torch `rules` (None: fp32).
    `precision` uniform with a micro-batch over one loss chunk
    (nagmoe/model/transformer.py, LOSS_CHUNK_ELEMENTS): the probes chunk their loss too, so the logits are not
    among the saved tensors, and the backward's transient is one chunk's logits, their gradient and softmax."""
    from nagmoe.model import build_model
    from nagmoe.model.transformer import LOSS_CHUNK_ELEMENTS

    chunk = max(1, LOSS_CHUNK_ELEMENTS // model_cfg.vocab_size)
    chunked = precision == "uniform" and tokens > chunk

    saved, working = {}, {}
    for n_layers in (1, 2):
        cfg = copy.deepcopy(model_cfg)
        cfg.n_layers = n_layers
        cfg.mod.skip_rate = 0.0  # full depth: skipping only saves
        torch.manual_seed(0)
        model = build_model(cfg).train()
        model.set_precision(precision)
        if chunked:
            model.loss_chunk_tokens = min(PROBE_TOKENS) // 4
        if checkpointing:
            from nagmoe.train.speed import enable_activation_checkpointing

            enable_activation_checkpointing(model)
        for t in PROBE_TOKENS:
            idx = torch.randint(0, cfg.vocab_size, (1, t), generator=torch.Generator().manual_seed(0))
            saved[n_layers, t] = _saved_bytes(model, idx, rules)
            if n_layers == 2:  # what the step holds beyond its saved tensors (one block's work at a time)
                working[t] = max(0, _peak_bytes(model, idx, rules) - saved[n_layers, t])
        del model
    t1, t2 = PROBE_TOKENS

    def per_token(n):  # bytes per token and per forward of the n-block copy
        slope = (saved[n, t2] - saved[n, t1]) / (t2 - t1)
        return slope, saved[n, t1] - slope * t1

    (tok1, fwd1), (tok2, fwd2) = per_token(1), per_token(2)
    block_tok, block_fwd = max(0.0, tok2 - tok1), max(0.0, fwd2 - fwd1)
    rest_tok, rest_fwd = max(0.0, tok1 - block_tok), max(0.0, fwd1 - block_fwd)
    L = model_cfg.n_layers
    # the working set beyond the saved tensors, linear in the tokens (it does not grow with depth); with a
    # chunked loss the probes' chunks are small: one real chunk's logits, gradient and softmax come on top
    work_tok = max(0.0, (working[t2] - working[t1]) / (t2 - t1))
    work_fwd = max(0.0, working[t1] - work_tok * t1)
    transient = tokens * work_tok + work_fwd + (3 * chunk * model_cfg.vocab_size * 4 if chunked else 0)
    return {"activations": int(tokens * (L * block_tok + rest_tok) + L * block_fwd + rest_fwd),
            "activations_per_token_block": block_tok, "activations_per_token_rest": rest_tok,
            "backward_transient": int(transient)}


def receive_worst_bytes(model_cfg, tokens: int, ep: int, bf16: bool) -> int:
    """The dropless worst case of one MoE layer's expert-parallel receive (module docstring); 0 without EP."""
    if ep <= 1 or model_cfg.ffn != "moe":
        return 0
    moe = model_cfg.moe
    K, E, D, H = moe.top_k, moe.n_experts, model_cfg.d_model, expert_hidden(model_cfg)
    rows = ep * tokens * K
    capacity = expert_capacity(moe.capacity_factor, tokens, K, E)
    if capacity is not None:
        rows = min(rows, ep * (E // ep) * capacity)
    act = 2 if bf16 else 4  # the payloads travel in the experts' compute dtype (bf16 under autocast)
    return rows * (2 * D + 2 * H) * act


def kept_logits_bytes(model_cfg, tokens: int, precision: str) -> int:
    """The logits a compiled chunked loss keeps for its backward over a micro-batch of `tokens` tokens when it
    does not recompute its chunks: tokens x vocab x 4 (it saves one (chunk, V) tensor per chunk, the decode
    matmul's output: fp32, or bf16 under autocast, an upper bound then). 0 when the loss is one chunk (never
    recomputed; the probes measure it)."""
    from nagmoe.model.transformer import LOSS_CHUNK_ELEMENTS

    chunked = precision == "uniform" and tokens > max(1, LOSS_CHUNK_ELEMENTS // model_cfg.vocab_size)
    return tokens * model_cfg.vocab_size * 4 if chunked else 0


def loss_recompute_needed(recompute_total: int, kept_bytes: int, device_memory_bytes: int) -> bool:
    """Recompute the loss's chunks in the backward only when keeping their logits (`kept_bytes`) on top of the
    estimate that recomputes them (`recompute_total`) would not fit the device."""
    return kept_bytes > 0 and recompute_total + kept_bytes > device_memory_bytes


def plan_loss_recompute(cfg, device_memory_bytes: int, ep: Optional[int] = None, world_size: int = 1,
                        estimate_bytes: Optional[int] = None) -> tuple:
    """(recompute, log line) for a CUDA trainer's start: `Transformer.loss_recompute` from the memory estimate
    at the trainer's micro-batch (`micro_batch_rows`). `estimate_bytes`: the total of an estimate made ahead for
    this layout with the chunks recomputed (the GPU check's committed one); None estimates here (minutes of
    host CPU at paper width). Only the compiled chunk keeps its logits (it saves one (chunk, V) tensor, the
    decode matmul's output; the eager chunk would save 3-4 fp32 ones: it recomputes, as before). Equal losses and
    gradients either way (tests/perf/test_compiled_loss.py)."""
    from nagmoe.train.speed import resolve_compile

    tokens = max(1, micro_batch_rows(cfg, world_size)) * cfg.data.seq_len
    kept = kept_logits_bytes(cfg.model, tokens, cfg.train.precision)
    if kept == 0:
        return True, "loss: one chunk per micro-batch, nothing recomputed"
    if not resolve_compile(cfg.train.compile, "cuda"):
        return True, "loss: eager chunks (train.compile off), each recomputed in the backward"
    if estimate_bytes is None:
        estimate_bytes = estimate_memory(cfg, ep=ep, micro_batch_tokens=tokens, device="cuda",
                                         world_size=world_size)["total"]
    recompute = loss_recompute_needed(estimate_bytes, kept, device_memory_bytes)
    return recompute, (f"loss: {'recompute each chunk in the backward' if recompute else 'keep every chunk'}: "
                       f"estimate {estimate_bytes / GIB:.1f} GiB + kept fp32 logits {kept / GIB:.1f} GiB "
                       f"{'>' if recompute else '<='} device {device_memory_bytes / GIB:.1f} GiB")


def estimate_memory(cfg, ep: Optional[int] = None, micro_batch_tokens: Optional[int] = None,
                    device: str = "cuda", world_size: Optional[int] = None, rules: Optional[str] = None,
                    loss_recompute: bool = True) -> dict:
    """Bytes per rank by part and their `total` for `cfg` at this layout (module docstring); `rules`: the torch
    version whose CUDA autocast rules apply (`estimate_rules`), named in `layout.cuda_rules`; `loss_recompute`:
    the loss's choice (`plan_loss_recompute`), False counts the kept logits in `activations`."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {device!r}")
    rules = estimate_rules(device, rules)
    ep = ep or cfg.parallel.ep
    seq = cfg.data.seq_len
    tokens = micro_batch_tokens or cfg.train.micro_batch_tokens or cfg.train.batch_tokens
    rows = max(1, tokens // seq)
    world = world_size if world_size is not None else ep
    out = {"layout": {"ep": ep, "world_size": world, "micro_batch_tokens": rows * seq, "device": device,
                      "cuda_rules": rules, "measured_with_torch": torch.__version__}}
    params = parameter_bytes(cfg.model, ep, cfg.train.optimizer, device)
    out.update(params)
    out["ddp_buckets"] = params["replicated_bytes"] if world > 1 else 0
    out.update(activation_bytes(cfg.model, rows * seq, rules, cfg.train.activation_checkpointing,
                                cfg.train.precision))
    out["loss_logits_kept"] = 0 if loss_recompute else kept_logits_bytes(cfg.model, rows * seq, cfg.train.precision)
    out["activations"] += out["loss_logits_kept"]
    out["layout"]["loss_recompute"] = loss_recompute
    out["receive_worst"] = receive_worst_bytes(cfg.model, rows * seq, ep, rules is not None)
    out["runtime"] = CUDA_RUNTIME_BYTES if device == "cuda" else CPU_PROCESS_BYTES
    # a background save's staging copy of the rank's state (issue 68, nagmoe/checkpoint/async_save.py): kept for
    # the whole run; host memory (pinned) on CUDA, so in the total only on the CPU
    from nagmoe.train.checkpoint_schedule import background_saves_on

    background = background_saves_on(cfg, world > 1, device)
    out["checkpoint_staging"] = params["parameters"] + params["optimizer"] if background else 0
    out["layout"]["checkpoint_async"] = background
    parts = ("parameters", "gradients", "ddp_buckets", "optimizer", "optimizer_workspace", "activations",
             "backward_transient", "receive_worst", "runtime") + (("checkpoint_staging",) if device == "cpu" else ())
    out["total"] = sum(out[k] for k in parts)
    out["parts"] = list(parts)
    return out


def micro_batch_rows(cfg, world_size: int) -> int:
    """Rows (sequences of data.seq_len) one rank runs per micro-step, the trainer's rule: this rank's share of
    train.batch_tokens, or fewer when train.micro_batch_tokens asks for gradient accumulation."""
    t, seq = cfg.train, cfg.data.seq_len
    rank_rows = t.batch_tokens // seq // max(1, world_size)
    return min(rank_rows, t.micro_batch_tokens // seq) if t.micro_batch_tokens else rank_rows


def eager_memory_refusal(cfg, device_memory_bytes: int, ep: int, world_size: int,
                         estimate_bytes: Optional[int] = None) -> Optional[str]:
    """The one-line refusal of a CUDA layout that runs eager (`train.compile` off on CUDA) and whose memory
    estimate (nagmoe.train.memory.estimate_memory, the one estimator) exceeds `device_memory_bytes`; None when
    it fits or when the blocks are compiled (the estimate is an eager upper bound). The micro-batch is the
    trainer's: `train.micro_batch_tokens`, at most this rank's share of `train.batch_tokens`. `estimate_bytes`: the
    total of an estimate made ahead for this layout (the GPU check's committed one), used instead of estimating
    here, which at paper width costs minutes of host CPU."""
    from nagmoe.train.speed import resolve_compile

    if resolve_compile(cfg.train.compile, "cuda"):
        return None
    tokens = max(1, micro_batch_rows(cfg, world_size)) * cfg.data.seq_len
    if estimate_bytes is not None:
        if estimate_bytes <= device_memory_bytes:
            return None
        return (f"train.compile={cfg.train.compile} (eager on CUDA): this layout needs about "
                f"{estimate_bytes / GIB:.1f} GiB per rank (memory estimate made ahead at train.micro_batch_tokens="
                f"{tokens}) but the device has {device_memory_bytes / GIB:.1f} GiB: lower train.micro_batch_tokens, "
                "or set train.compile=true (or auto), or train.activation_checkpointing=true")
    est = estimate_memory(cfg, ep=ep, micro_batch_tokens=tokens, device="cuda", world_size=world_size)
    if est["total"] <= device_memory_bytes:
        return None
    biggest = max(est["parts"], key=lambda k: est[k])
    return (f"train.compile={cfg.train.compile} (eager on CUDA): this layout needs about {est['total'] / GIB:.1f} "
            f"GiB per rank (memory estimate at train.micro_batch_tokens={tokens}, parallel.ep={ep}, world size "
            f"{world_size}; largest part {biggest} {est[biggest] / GIB:.1f} GiB) but the device has "
            f"{device_memory_bytes / GIB:.1f} GiB: lower train.micro_batch_tokens, or set train.compile=true "
            f"(or auto), or train.activation_checkpointing=true")


def format_memory(est: dict) -> str:
    lay = est["layout"]
    rules = lay.get("cuda_rules")
    precision = f"bf16 under CUDA's autocast rules of torch {rules}" if rules else "fp32"
    lines = [f"memory per rank ({lay['device']}, ep {lay['ep']}, world {lay['world_size']}, micro-batch "
             f"{lay['micro_batch_tokens']:,} tokens; activations {precision}):"]
    for k in est["parts"]:
        lines.append(f"  {k:<20} {est[k] / GIB:9.2f} GiB")
        if k == "optimizer":
            lines += [f"    {role:<18} {b / GIB:9.2f} GiB" for role, b in est["optimizer_by_role"].items()]
    lines.append(f"  {'total':<20} {est['total'] / GIB:9.2f} GiB")
    return "\n".join(lines)
