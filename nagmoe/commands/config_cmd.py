"""`nagmoe config --config PATH [key=value ...]`: print the resolved config."""
from nagmoe.commands.common import add_config_arguments, config_from_args
from nagmoe.config import dump_yaml


def add_arguments(p):
    add_config_arguments(p)


def run(args) -> int:
    print(dump_yaml(config_from_args(args)), end="")
    return 0
