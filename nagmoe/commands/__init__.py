"""One module per `nagmoe` subcommand: `add_arguments(parser)` and `run(args) -> int`."""
