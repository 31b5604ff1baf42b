"""User-facing errors.

Note: every error a user can cause by bad input (a model name, a config file, a flag) is raised as
an `OpWeaveError` with a one-line message. The CLI prints it as `opweave: error: <message>` and
exits with status 2; anything else escaping the CLI is a bug in OpWeave and keeps its traceback.
"""


class OpWeaveError(Exception):
    """Bad input or an unsupported request, explained in one line."""

    exit_code = 2
