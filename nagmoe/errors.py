"""User-facing errors: the CLI prints their message as one line and exits with code 2."""


class UserError(Exception):
    """Bad user input (config, paths, data): the message names what is wrong."""
