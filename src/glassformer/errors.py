"""The one exception type for bad user input (the CLI prints it as one `error:` line, exit 2).
Reading a user's JSON file with this error is files.read_json."""


class UserError(Exception):
    """Input the user can fix; the message says how."""


class DiskFullError(UserError, OSError):
    """A write the disk had no room for (files.atomic_folder): a UserError, so one line naming the folder
    and the bytes, and an OSError, so code that catches a failed write (train's checkpoint) still does."""
