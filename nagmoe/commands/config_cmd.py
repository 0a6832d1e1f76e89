"""`nagmoe config --config PATH [key=value ...]`: print the resolved config; then exit 2 with one line when
`data.data_dir` is not prepared and this machine cannot prepare `data.corpus` (nagmoe/data/corpus.py,
`check_data_preparable`: e.g. the paper configs' bare `climbmix`, docs/paper-corpus.md)."""
from nagmoe.commands.common import add_config_arguments, config_from_args
from nagmoe.config import dump_yaml


def add_arguments(p):
    add_config_arguments(p)


def run(args) -> int:
    from nagmoe.data.corpus import check_data_preparable

    cfg = config_from_args(args)
    print(dump_yaml(cfg), end="", flush=True)
    check_data_preparable(cfg, args.config)
    return 0
