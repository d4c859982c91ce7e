"""The errors that several layers of ``stages/common`` raise, in a module that imports nothing of the project (so
the recipe reader, the command line, the launcher and the cluster code each import it, never each other, for them)."""

from __future__ import annotations


class RecipeError(ValueError):
    """A recipe file or override is unreadable or does not fit the stage's config."""


class StageFailed(RuntimeError):
    """A rank of a stage failed; the message carries its traceback."""


class StageTimeout(StageFailed):
    """A stage's ranks did not finish within its deadline; the message names the ranks still running."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (a rendezvous's, a process group's)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
