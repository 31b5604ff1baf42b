"""User-facing errors.

Note: every error a user can cause by bad input (a model name, a config file, a flag) is raised as
an `OpWeaveError` with a one-line message. The CLI prints it as `opweave: error: <message>` and
exits with status 2; anything else escaping the CLI is a bug in OpWeave and keeps its traceback.
"""


class OpWeaveError(Exception):
    """Bad input or an unsupported request, explained in one line."""

    exit_code = 2


class Interrupted(BaseException):
    """A termination signal (SIGTERM, SIGHUP) raised as an exception in the main thread.

    Note: it derives from BaseException, like KeyboardInterrupt, so that `except Exception` does not
    swallow it while every `finally` and `except BaseException` cleanup on the way out still runs
    (a temporary artifact folder removed, rank processes stopped). `opweave.signals` raises it and
    the CLI turns it into one line and exit status 128 + signum.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        import signal

        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"
