"""Argument helpers shared by subcommands."""
from __future__ import annotations

import argparse

from nagmoe.config import Config, load_config


def add_config_arguments(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config", required=required, help="YAML config (may use inherit:)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides")


def config_from_args(args) -> Config:
    return load_config(args.config, args.overrides)
