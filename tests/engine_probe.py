"""Functions the engine tests run on workers (importable by name in a child process)."""

from __future__ import annotations


def parent_command_line() -> str:
    """The command line of this process's parent (a forkserver, or a nanny)."""
    import psutil
    parent = psutil.Process().parent()
    return " ".join(parent.cmdline()) if parent else ""
