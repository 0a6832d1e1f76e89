"""Argument helpers shared by subcommands."""
from __future__ import annotations

import argparse
import contextlib

from nagmoe.config import Config, load_config


def add_config_arguments(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config", required=required, help="YAML config (may use inherit:)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides")


def config_from_args(args) -> Config:
    return load_config(args.config, args.overrides)


@contextlib.contextmanager
def launched_process_group(cfg: Config):
    """The launcher's world (torchrun or srun variables) for `cfg`: `parallel.*` checked against its size
    before any process group exists (exit 2), the device (cuda:LOCAL_RANK under a launcher), the process group
    up for the block and shut down after. Yields (dist env, device)."""
    import torch

    from nagmoe.parallel.env import init_distributed, read_dist_env, shutdown_distributed
    from nagmoe.parallel.mesh import validate_parallel
    from nagmoe.train.trainer import resolve_device

    env = read_dist_env()
    validate_parallel(cfg, env.world_size)
    device = resolve_device(cfg.train.device)
    if device.type == "cuda" and env.distributed:
        device = torch.device("cuda", env.local_rank)
    created = init_distributed(env, device)
    try:
        yield env, device
    finally:
        if created:
            shutdown_distributed()
