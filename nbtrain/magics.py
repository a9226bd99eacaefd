"""``%load_ext nbtrain``: line magics for the common moves in a lab notebook.

::

    %load_ext nbtrain
    %nbtrain connect                      # embedded cluster (or: connect tcp://host:8786)
    %nbtrain jobs                         # every client's jobs on the cluster
    %nbtrain attach alice-long            # handle in the variable `job` (--as NAME)
    %nbtrain dashboard alice-long         # its live page (no name: the class view)
    %nbtrain preempt|resume|checkpoint|stop alice-long
    %nbtrain status alice-long
    %nbtrain set alice-long lr=3e-4 aux_weight=0.2 [--ramp 100 --shape cosine]
    %nbtrain knobs alice-long             # values in force, who changed what at which step

The magics only call the public API (``nbtrain.connect``, ``cluster.jobs``, ``cluster.job``,
``job.dashboard``...), so what they do is what the same lines of Python would do; the cluster
they use is the variable ``cluster`` of the notebook (set by ``%nbtrain connect``, or your
own). Steering follows the API's ownership rules: a job's own notebook (or the operator) may
stop it, everyone else gets the refusal with the reason.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from typing import Any

__all__ = ["NbtrainMagics", "load_ipython_extension"]

ACTIONS = ("preempt", "resume", "checkpoint", "stop")
USAGE = """\
%nbtrain connect [ADDRESS] [--workers N] [--as NAME]   connect (embedded cluster without ADDRESS)
%nbtrain jobs                                          the cluster's jobs, every client's
%nbtrain attach JOB [--as NAME]                        a job's handle into a variable (job)
%nbtrain dashboard [JOB] [--display auto|page|widget|text]
                                                       a job's live page; no JOB: class view
%nbtrain status JOB                                    state, step, reason
%nbtrain preempt|resume|checkpoint|stop JOB            steer a job (owner or operator)
%nbtrain set JOB NAME=VALUE ... [--ramp N] [--shape linear|cosine]
                                                       change live knobs (job.set)
%nbtrain knobs JOB                                     a job's knobs and their history
%nbtrain close                                         close the notebook's cluster connection
JOB is a job's name (the newest of that name) or id. The cluster is the notebook's `cluster`
variable (--cluster NAME for another)."""


class MagicError(Exception):
    """A magic's misuse, shown as one line (no traceback)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would sys.exit()
        raise MagicError(f"{message}\n\n{USAGE}")


def _parser() -> _Parser:
    parser = _Parser(prog="%nbtrain", add_help=False)
    parser.add_argument("command", nargs="?", default="help")
    parser.add_argument("target", nargs="?")
    parser.add_argument("values", nargs="*")  # set: NAME=VALUE ...
    parser.add_argument("--ramp", type=int, default=0)
    parser.add_argument("--shape", default="linear")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--as", dest="var", default=None)
    parser.add_argument("--display", default=None)
    parser.add_argument("--cluster", default="cluster")
    return parser


class NbtrainMagics:
    """The ``%nbtrain`` line magic over one IPython shell's namespace."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.commands: dict[str, Callable[[argparse.Namespace], Any]] = {
            "help": self._help, "connect": self._connect, "jobs": self._jobs,
            "attach": self._attach, "dashboard": self._dashboard, "status": self._status,
            "close": self._close, "set": self._set, "knobs": self._knobs,
            **{a: self._steer for a in ACTIONS}}

    def __call__(self, line: str) -> Any:
        try:
            args = _parser().parse_args(shlex.split(line))
            command = self.commands.get(args.command)
            if command is None:
                raise MagicError(f"unknown command {args.command!r}\n\n{USAGE}")
            return command(args)
        except (MagicError, PermissionError, LookupError, ValueError, RuntimeError,
                TimeoutError) as exc:
            # what went wrong, with the fix, as one message (no traceback for misuse)
            message = exc.args[0] if isinstance(exc, LookupError) and exc.args else exc
            print(f"%nbtrain: {message}")
            return None

    # -- commands ---------------------------------------------------------------------------
    def _help(self, _args: argparse.Namespace) -> None:
        print(USAGE)

    def _connect(self, args: argparse.Namespace) -> Any:
        import nbtrain

        var = args.var or args.cluster
        old = self.shell.user_ns.get(var)
        if isinstance(old, nbtrain.Cluster):
            raise MagicError(f"`{var}` is already a cluster ({old.address}); %nbtrain close "
                             f"it first, or connect --as another name")
        cluster = nbtrain.connect(args.target, n_workers=args.workers)
        self.shell.user_ns[var] = cluster
        print(f"connected: `{var}` = {cluster!r}")
        return None

    def _jobs(self, args: argparse.Namespace) -> None:
        jobs = self._cluster(args).jobs
        if not jobs:
            print("no jobs on this cluster yet")
            return
        print(f"{'name':18} {'id':10} {'owner':10} {'team':10} {'state':10} {'step':>14}  reason")
        for job in jobs:
            step = "(hidden)" if job.hidden else job.spec.progress(job.step)
            print(f"{job.name:18} {job.id[:10]:10} {job.owner:10} {job.spec.team:10} "
                  f"{job.status.value:10} {step:>14}  {job.reason}")

    def _attach(self, args: argparse.Namespace) -> Any:
        job = self._job(args)
        var = args.var or "job"
        self.shell.user_ns[var] = job
        print(f"attached: `{var}` = {job!r}")
        return None

    def _dashboard(self, args: argparse.Namespace) -> Any:
        if args.target in (None, "cluster"):
            return self._cluster(args).dashboard(display=args.display)
        return self._job(args).dashboard(display=args.display)

    def _status(self, args: argparse.Namespace) -> None:
        job = self._job(args)
        if job.hidden:
            print(f"{job.name}: {job.status.value}, owner {job.owner} - {job.hidden}")
            return
        print(f"{job.name}: {job.status.value} at step {job.spec.progress(job.step)}, "
              f"generation {max(job.generation, 0)}, restarts {job.restarts} - {job.reason}")

    def _steer(self, args: argparse.Namespace) -> None:
        job = self._job(args)
        getattr(job, args.command)()
        print(f"{args.command} requested for {job.name} (now {job.status.value})")

    def _set(self, args: argparse.Namespace) -> None:
        values: dict[str, float] = {}
        for item in args.values:
            name, sep, text = item.partition("=")
            try:
                values[name] = float(text)
            except ValueError:
                sep = ""
            if not sep or not name:
                raise MagicError(f"`%nbtrain set JOB NAME=VALUE ...` takes numbers, got "
                                 f"{item!r}")
        if not values:
            raise MagicError("`%nbtrain set JOB NAME=VALUE ...` needs at least one knob; "
                             "`%nbtrain knobs JOB` lists them")
        job = self._job(args)
        step = job.set(ramp=args.ramp, shape=args.shape, **values)
        print(f"{', '.join(args.values)} applied by every rank of {job.name} at step {step}")

    def _knobs(self, args: argparse.Namespace) -> None:
        print(repr(self._job(args).knobs))

    def _close(self, args: argparse.Namespace) -> None:
        cluster = self._cluster(args)
        cluster.close()
        del self.shell.user_ns[args.cluster]
        print(f"closed `{args.cluster}`")

    # -- helpers ----------------------------------------------------------------------------
    def _cluster(self, args: argparse.Namespace) -> Any:
        import nbtrain

        cluster = self.shell.user_ns.get(args.cluster)
        if not isinstance(cluster, nbtrain.Cluster):
            raise MagicError(f"no cluster in `{args.cluster}`: run `%nbtrain connect` "
                             f"(or `{args.cluster} = nbtrain.connect(...)`) first")
        return cluster

    def _job(self, args: argparse.Namespace) -> Any:
        if not args.target:
            raise MagicError(f"`%nbtrain {args.command}` needs a job's name or id; "
                             "`%nbtrain jobs` lists them")
        return self._cluster(args).job(args.target)  # unknown: LookupError listing the jobs


def load_ipython_extension(ipython: Any) -> None:
    """Called by ``%load_ext nbtrain``: registers the ``%nbtrain`` line magic."""
    ipython.register_magic_function(NbtrainMagics(ipython), magic_kind="line",
                                    magic_name="nbtrain")
