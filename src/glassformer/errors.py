"""The one exception type for bad user input: the CLI prints it as one `error:` line, exit 2."""


class UserError(Exception):
    """Input the user can fix; the message says how."""
