"""The one error path of every ``offpolicy-moe`` command: ``offpolicy-moe <command>: error: <one line>`` on stderr.

Exit code :data:`USER_ERROR` (2) for a user mistake, raised before any folder is created or any compute starts;
:data:`RUN_FAILED` (1) for a run that started and failed (diverged, an unreadable checkpoint, a failed sweep run);
:data:`INTERRUPTED` (130) for Ctrl-C.  Anything else is a bug and keeps its traceback.  Warnings are printed once
per run as ``offpolicy-moe <command>: warning: <one line>`` (:class:`WarningLines`).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from typing import Iterator, NoReturn


USER_ERROR = 2
RUN_FAILED = 1
INTERRUPTED = 130


class UsageError(ValueError):
    """A user mistake on the command line (an option, a metric or axis name, a folder): exit code 2."""


class RunFailed(RuntimeError):
    """A run or sweep that started and failed: exit code 1."""


#: user mistakes (exit code 2), as (module, class); the engine's are named, not imported, so that the parser and
#: ``--help`` do not load torch: an exception of a module that was never imported cannot have been raised
USER_ERRORS = (("offpolicy_moe.commands.errors", "UsageError"), ("offpolicy_moe.config.validate", "ConfigError"),
               ("offpolicy_moe.run.run_dir_checks", "RunDirError"), ("offpolicy_moe.trainer.eval_run", "EvalInputError"))
#: a run that started and failed (exit code 1)
RUN_ERRORS = (("offpolicy_moe.commands.errors", "RunFailed"), ("offpolicy_moe.run.checkpoint", "CheckpointError"),
              ("offpolicy_moe.run.nonfinite", "NonFiniteError"),
              ("offpolicy_moe.tasks.custom_rewards", "RewardError"))


def _loaded(names: tuple[tuple[str, str], ...]) -> tuple[type, ...]:
    return tuple(getattr(sys.modules[m], c) for m, c in names if m in sys.modules and hasattr(sys.modules[m], c))


def one_line(exc: BaseException) -> str:
    """The exception's message on one line: continuation lines (list items ``- ...``) joined with ``; ``."""
    text = str(exc).strip() or type(exc).__name__
    first, *rest = [part.strip() for part in text.splitlines() if part.strip()]
    items = "; ".join(r[2:] if r.startswith("- ") else r for r in rest)
    if not items:
        return first
    return f"{first} {items}" if first.endswith(":") else f"{first}; {items}"


def error_line(command: str, exc: BaseException) -> str:
    """``offpolicy-moe <command>: error: <message>``."""
    return f"offpolicy-moe {command}: error: {one_line(exc)}"


def exit_code(exc: BaseException) -> int | None:
    """The exit code of a known failure class, or None for an unexpected exception (a bug)."""
    if isinstance(exc, KeyboardInterrupt):    # a stop by SIGTERM carries its own code (143)
        return int(getattr(exc, "exit_code", INTERRUPTED))
    if isinstance(exc, _loaded(USER_ERRORS)):
        return USER_ERROR
    if isinstance(exc, _loaded(RUN_ERRORS)):
        return RUN_FAILED
    return None


class CommandWarning(UserWarning):
    """A warning of a command about its own input (a legal but probably unintended config)."""


def warn(message: str) -> None:
    """Warn about the command's input: under :meth:`WarningLines.capture` (every CLI command) one line
    ``offpolicy-moe <command>: warning: <message>``, said once per run."""
    warnings.warn(message, CommandWarning, stacklevel=2)


class WarningLines:
    """The warnings of one command run, each printed once as ``offpolicy-moe <command>: warning: <message>``."""

    def __init__(self, command: str):
        self.command = command
        self.said: list[str] = []

    def say(self, message: str) -> None:
        """Print ``message`` (joined into one line) unless this run said it already."""
        text = one_line(ValueError(str(message)))
        if text not in self.said:
            self.said.append(text)
            print(f"offpolicy-moe {self.command}: warning: {text}", file=sys.stderr, flush=True)

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        self.say(str(message))

    @contextlib.contextmanager
    def capture(self) -> Iterator["WarningLines"]:
        """Inside the block every shown warning goes through :meth:`say` (Python's filters still decide which are
        shown; a command's own warnings always are)."""
        with warnings.catch_warnings():
            warnings.simplefilter("always", CommandWarning)
            warnings.showwarning = self._show
            yield self


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``<prog>: error: ...``, exit code 2), without the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(USER_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
