"""The one exception type for bad user input (the CLI prints it as one `error:` line, exit 2),
and reading the JSON files users hand us with that error."""


import json
from pathlib import Path


class UserError(Exception):
    """Input the user can fix; the message says how."""


def read_json(path: str | Path, hint: str = ""):
    """The JSON in a user-given file; a UserError naming the file if it does not parse."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}){hint}") from None
