"""User errors: one clear line naming the file, key or job at fault; the CLI exits with code 2."""


class UserError(Exception):
    """Bad input from the user (config, command line, run directory). Printed as one line, exit 2."""

    exit_code = 2
