"""An unmodified torchrun-style script as the unit of work (torch-free: built on the client).

``cluster.submit_script("train.py", args=[...], world_size=n)`` and ``nbtrain run train.py --
ARGS`` read the script's source on the client and send it with the job, so workers need not
see the file. Every rank runs it in a child process (:mod:`nbtrain.runtime.script_rank`) the
way torchrun runs it: ``python -u train.py ARGS`` with the torchrun environment.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ScriptWork", "is_script", "load_script"]

_MAIN_GUARD = re.compile(r"""^if\s+__name__\s*==\s*['"]__main__['"]\s*:""", re.MULTILINE)


@dataclass(frozen=True)
class ScriptWork:
    """A script's source, its name, its arguments and where it was submitted from."""

    source: str
    filename: str  # the script's base name (its ``__file__`` in the rank is a copy's path)
    args: tuple[str, ...] = ()
    #: The client's working directory and the script's directory when submitted: the child
    #: runs there when the worker sees it (relative paths in ``args`` then mean what they
    #: meant on the client), else in a temporary directory.
    cwd: str = ""
    script_dir: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return Path(self.filename).stem


def is_script(path: str | os.PathLike[str]) -> bool:
    """True for an existing ``.py`` file with an ``if __name__ == "__main__":`` block."""
    p = Path(path)
    if p.suffix != ".py" or not p.is_file():
        return False
    return bool(_MAIN_GUARD.search(p.read_text(encoding="utf-8", errors="replace")))


def load_script(path: str | os.PathLike[str], args: list[str] | tuple[str, ...] = (), *,
                cwd: str | None = None,
                env: dict[str, str] | None = None) -> ScriptWork:
    """Read the script at ``path`` into a :class:`ScriptWork` (ValueError naming the fix)."""
    p = Path(path).resolve()
    if not p.is_file():
        raise ValueError(f"no such script: {path} (looked in {Path.cwd()})")
    try:
        source = p.read_text(encoding="utf-8")
        compile(source, str(p), "exec")
    except (UnicodeDecodeError, SyntaxError) as err:
        raise ValueError(f"cannot run {path} as a Python script: {err}") from err
    if not all(isinstance(a, str) for a in args):
        raise TypeError(f"script args must be strings (as on a command line), got {list(args)!r}")
    return ScriptWork(source=source, filename=p.name, args=tuple(args),
                      cwd=str(Path(cwd).resolve()) if cwd else os.getcwd(),
                      script_dir=str(p.parent), env=dict(env or {}))
