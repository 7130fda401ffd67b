"""The one exception type for bad user input (the CLI prints it as one `error:` line, exit 2).
Reading a user's JSON file with this error is files.read_json."""


class UserError(Exception):
    """Input the user can fix; the message says how."""
