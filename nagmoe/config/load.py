"""Loading a config: YAML with `inherit:`, dotted overrides, validation (the schema: nagmoe.config.schema).

Every key a user can set lives in one of the dataclasses of nagmoe.config.schema (re-exported here); the dotted path
of a field (`model.moe.top_k`) is its override name. Validation never asserts: it raises `ConfigError`
naming the key, the value and what is allowed, and the CLI turns that into one line and exit code 2.
Validation sits above the accounting (nagmoe.config.flops), which it needs for the budget checks.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional

from nagmoe.base.errors import UserError, shown
from nagmoe.config.flops import flops_per_token
from nagmoe.config.schema import (
    CHOICES,
    LEGACY_VALUES,
    NON_NEGATIVE,
    POSITIVE,
    RESUMABLE_KEYS,
    AttentionConfig,
    Config,
    ConfigError,
    DataConfig,
    LogConfig,
    MoDConfig,
    MoEConfig,
    ModelConfig,
    NAGConfig,
    ParallelConfig,
    TrainConfig,
    _from_dict,
    _read_yaml_tree,
    attention_heads,
    dump_yaml,
    expert_hidden,
    get_key,
    missing_legacy_keys,
    parse_overrides,
    set_key,
    to_dict,
    yaml_load,
)

__all__ = [  # the schema's names are re-exported: `from nagmoe.config import ...` is the public face
    "CHOICES", "LEGACY_VALUES", "NON_NEGATIVE", "POSITIVE", "RESUMABLE_KEYS", "AttentionConfig", "Config", "ConfigError",
    "DataConfig", "LogConfig", "MoDConfig", "MoEConfig", "ModelConfig", "NAGConfig", "ParallelConfig",
    "TrainConfig", "attention_heads", "budget_tokens", "config_from_dict", "dump_yaml", "expert_hidden",
    "get_key", "load_config", "parse_overrides", "set_key", "to_dict", "validate_config", "yaml_load",
]


def load_config(path: Optional[str] = None, overrides: Iterable[str] = (), validate: bool = True) -> Config:
    """Read a YAML config (following `inherit:`), apply dotted overrides in order, validate."""
    data = _read_yaml_tree(path) if path else {}
    cfg = _from_dict(Config, data)
    for k, v in parse_overrides(overrides):
        set_key(cfg, k, v)
    if validate:
        validate_config(cfg)
    return cfg


def config_from_dict(data: dict, validate: bool = True, legacy: bool = False) -> Config:
    """`legacy`: `data` is a saved config; keys it predates take their LEGACY_VALUES (the migration rule)."""
    cfg = _from_dict(Config, data)
    if legacy:
        for key, value in missing_legacy_keys(data).items():
            set_key(cfg, key, value)
    if validate:
        validate_config(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------
def budget_tokens(cfg: Config) -> Optional[float]:
    """Tokens the run will see at most, from max_steps and/or the FLOP budget (None = unbounded)."""
    bounds = []
    if cfg.train.max_steps is not None:
        bounds.append(cfg.train.max_steps * cfg.train.batch_tokens)
    if cfg.train.flop_budget is not None:
        bounds.append(cfg.train.flop_budget / flops_per_token(cfg.model, cfg.data.seq_len,
                                                              convention=cfg.train.flop_convention))
    if not bounds and cfg.train.schedule_steps:
        bounds.append(cfg.train.schedule_steps * cfg.train.batch_tokens)
    return min(bounds) if bounds else None


def _leaf_values(obj, prefix: str = ""):
    """(dotted key, value) of every leaf field of a config dataclass."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaf_values(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def _check_mod_thresholds(mod) -> None:
    if mod.threshold == "fixed":
        if mod.p_thres is None:
            raise ConfigError("model.mod.p_thres: required by model.mod.threshold=fixed (a rotation score in [0, 1))")
        if not 0.0 <= mod.p_thres < 1.0:
            raise ConfigError(f"model.mod.p_thres: {mod.p_thres} must be in [0, 1)")
    elif mod.p_thres is not None:
        raise ConfigError("model.mod.p_thres: only for model.mod.threshold=fixed (threshold is "
                          f"{shown(mod.threshold)})")
    cap = mod.max_sublayer_skip
    if cap is not None:
        if not 0.0 < cap <= 1.0:
            raise ConfigError(f"model.mod.max_sublayer_skip: {cap} must be in (0, 1] (or null for no ceiling)")
        if mod.skip_rate > cap:
            raise ConfigError(f"model.mod.max_sublayer_skip: {cap} is below model.mod.skip_rate={mod.skip_rate}: "
                              "no sublayer may skip more than the ceiling, so the target cannot be met")


SIZE_LIMIT = 2 ** 31  # one dimension (a width, a count of layers, heads, experts, tokens in a sequence)
PARAM_LIMIT = 2 ** 40  # ~1.1e12 parameters: far beyond any machine this runs on, well inside int64 arithmetic
SIZE_KEYS = ("model.vocab_size", "model.d_model", "model.n_layers", "model.max_seq_len", "model.mlp_hidden",
             "model.attention.n_heads", "model.attention.n_kv_heads", "model.attention.head_dim",
             "model.attention.q_compression", "model.attention.kv_compression", "model.attention.conv_kernel_1",
             "model.attention.conv_kernel_2", "model.moe.n_experts", "model.moe.top_k", "model.moe.expert_hidden",
             "model.nag.C", "data.seq_len")


def _check_sizes(cfg: Config) -> None:
    """Sizes a model can have: each dimension below 2**31 and the whole model below 2**40 parameters, so a
    typo (`model.d_model=2**40`) is one line naming the key, not an overflow in torch or a memory estimate."""
    for key in SIZE_KEYS:
        v = get_key(cfg, key)
        if v is not None and v >= SIZE_LIMIT:
            raise ConfigError(f"{key}: {v} is too large (at most {SIZE_LIMIT - 1})")
    from nagmoe.config.flops import param_counts

    try:
        total = param_counts(cfg.model)["total"]
    except (UserError, ZeroDivisionError, ValueError):
        return  # the geometry checks below name the key
    if total > PARAM_LIMIT:
        raise ConfigError(f"model: {total:.3g} parameters is more than {PARAM_LIMIT:.3g} (model.d_model="
                          f"{cfg.model.d_model}, model.n_layers={cfg.model.n_layers}, model.vocab_size="
                          f"{cfg.model.vocab_size}, model.moe.n_experts={cfg.model.moe.n_experts})")


LB_GRANULARITIES = ("micro_batch", "sequence", "global_batch")


def validate_config(cfg: Config) -> None:
    for key, v in _leaf_values(cfg):  # nan/inf parse as floats ("nan", ".inf") but are never a setting
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{key}: {shown(v)} must be a finite number")
    for key, allowed in CHOICES.items():
        v = get_key(cfg, key)
        if v not in allowed:
            raise ConfigError(f"{key}: {shown(v)} is not one of {', '.join(allowed)}")
    for key in POSITIVE:
        v = get_key(cfg, key)
        if v is not None and v <= 0:
            raise ConfigError(f"{key}: {shown(v)} must be > 0")
    for key in NON_NEGATIVE:
        v = get_key(cfg, key)
        if v is not None and v < 0:
            raise ConfigError(f"{key}: {shown(v)} must be >= 0")
    _check_sizes(cfg)
    m, a = cfg.model, cfg.model.attention
    if a.head_dim is None and m.d_model % a.n_heads:
        raise ConfigError(
            f"model.d_model: {m.d_model} is not divisible by model.attention.n_heads={a.n_heads}")
    n_kv = a.n_kv_heads or a.n_heads
    if a.n_heads % n_kv:
        raise ConfigError(
            f"model.attention.n_kv_heads: {n_kv} must divide model.attention.n_heads={a.n_heads}")
    if a.kind == "cca":  # head geometry of CCA/CCGQA: one rule, shared with the model and the accounting
        try:
            attention_heads(m)
        except UserError as e:
            raise ConfigError(str(e)) from None
    if not 0.0 <= a.rope_fraction <= 1.0:
        raise ConfigError(f"model.attention.rope_fraction: {a.rope_fraction} must be in [0, 1]")
    if m.ffn == "moe":
        if m.moe.top_k > m.moe.n_experts:
            raise ConfigError(
                f"model.moe.top_k: {m.moe.top_k} exceeds model.moe.n_experts={m.moe.n_experts}")
        if m.residual == "nag" and m.nag.C < m.moe.n_experts:
            raise ConfigError(
                f"model.nag.C: {m.nag.C} must be >= model.moe.n_experts={m.moe.n_experts} for NAG MoE sublayers")
        if cfg.parallel.ep > 1 and m.moe.n_experts % cfg.parallel.ep:
            raise ConfigError(
                f"parallel.ep: {cfg.parallel.ep} must divide model.moe.n_experts={m.moe.n_experts}")
    if not 0.0 <= m.mod.skip_rate < 1.0:
        raise ConfigError(f"model.mod.skip_rate: {m.mod.skip_rate} must be in [0, 1)")
    if m.mod.skip_rate > 0 and m.residual != "nag":
        raise ConfigError("model.mod.skip_rate: MoD needs model.residual=nag (the rotation score routes)")
    _check_mod_thresholds(m.mod)
    if not (math.isfinite(m.moe.bias_update_rate) and m.moe.bias_update_rate >= 0):
        raise ConfigError(f"model.moe.bias_update_rate: {m.moe.bias_update_rate} must be finite and >= 0")
    if m.moe.lb_granularity not in LB_GRANULARITIES:
        raise ConfigError(f"model.moe.lb_granularity: {shown(m.moe.lb_granularity)} is not one of "
                          f"{', '.join(LB_GRANULARITIES)}")
    if m.moe.expert_bias and m.ffn != "moe":
        raise ConfigError("model.moe.expert_bias: the expert bias balances MoE routing; model.ffn is "
                          f"{shown(m.ffn)} (set model.ffn=moe or model.moe.expert_bias=false)")
    if m.moe.capacity_factor is not None and not m.moe.capacity_factor > 0:
        raise ConfigError(f"model.moe.capacity_factor: {m.moe.capacity_factor} must be > 0 (or null: dropless)")
    if m.nag.beta_init <= 0:
        raise ConfigError(f"model.nag.beta_init: {m.nag.beta_init} must be > 0")
    if cfg.data.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction: {cfg.data.val_fraction} must be in (0, 1)")
    t = cfg.train
    if t.batch_tokens % cfg.data.seq_len:
        raise ConfigError(f"train.batch_tokens: {t.batch_tokens} must be a multiple of data.seq_len={cfg.data.seq_len}")
    if t.micro_batch_tokens is not None and (
            t.micro_batch_tokens % cfg.data.seq_len or t.batch_tokens % t.micro_batch_tokens):
        raise ConfigError(
            f"train.micro_batch_tokens: {t.micro_batch_tokens} must be a multiple of data.seq_len and divide "
            f"train.batch_tokens={t.batch_tokens}")
    if not 0.0 <= t.warmdown_frac <= 1.0:
        raise ConfigError(f"train.warmdown_frac: {t.warmdown_frac} must be in [0, 1]")
    if not 0.0 <= t.final_lr_frac <= 1.0:
        raise ConfigError(f"train.final_lr_frac: {t.final_lr_frac} must be in [0, 1]")
    if not 0.0 <= t.gate_collapse_fraction <= 1.0:
        raise ConfigError(f"train.gate_collapse_fraction: {t.gate_collapse_fraction} must be in [0, 1]")
    if not 0.0 <= t.muon_momentum < 1.0:
        raise ConfigError(f"train.muon_momentum: {t.muon_momentum} must be in [0, 1)")
    if m.residual == "nag" and m.nag.warmup_tokens:
        budget = budget_tokens(cfg)
        if budget is not None and m.nag.warmup_tokens >= budget:
            raise ConfigError(
                f"model.nag.warmup_tokens: {m.nag.warmup_tokens} must be below the run's budget "
                f"(~{int(budget)} tokens)")
