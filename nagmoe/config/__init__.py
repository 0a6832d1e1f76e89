"""The config stack (issue 54): what a run is, before anything is built. `from nagmoe.config import ...` is the public
face (DESIGN.md: `nagmoe.config.load_config`).

  schema.py        the dataclasses (every key a user can set), choices, bounds, LEGACY_VALUES for old run dirs
  load.py          YAML with `inherit:`, dotted overrides, validation naming the key and what is allowed
  yaml_files.py    bounded YAML reading (aliases, depth, size) with one-line errors
  flops.py         analytic parameter counts and FLOPs per token (also `nagmoe.flops`, the contract name)
  shape_solver.py  a model shape for a target parameter count (`nagmoe params --solve`)
"""
from nagmoe.config.load import (CHOICES, LEGACY_VALUES, NON_NEGATIVE, POSITIVE, RESUMABLE_KEYS, AttentionConfig,
                                Config, ConfigError, DataConfig, LogConfig, MoDConfig, MoEConfig, ModelConfig,
                                NAGConfig, ParallelConfig, TrainConfig, attention_heads, budget_tokens,
                                config_from_dict, dump_yaml, expert_hidden, get_key, load_config,
                                missing_legacy_keys, parse_overrides, set_key, to_dict, validate_config, yaml_load)

__all__ = [
    "CHOICES", "LEGACY_VALUES", "NON_NEGATIVE", "POSITIVE", "RESUMABLE_KEYS", "AttentionConfig", "Config", "ConfigError",
    "DataConfig", "LogConfig", "MoDConfig", "MoEConfig", "ModelConfig", "NAGConfig", "ParallelConfig",
    "TrainConfig", "attention_heads", "budget_tokens", "config_from_dict", "dump_yaml", "expert_hidden",
    "get_key", "load_config", "missing_legacy_keys", "parse_overrides", "set_key", "to_dict", "validate_config",
    "yaml_load",
]
