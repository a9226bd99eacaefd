"""``nbtrain run FILE_OR_MODULE:FUNCTION`` or ``nbtrain run SCRIPT.py -- ARGS``: a training
function, or an unmodified torchrun-style script, from a shell, a script or CI.

    nbtrain run train.py:train --world-size 4 --steps 2000 --config lr=3e-4 --config batch=256
    nbtrain run mypkg.training:main --address tcp://scheduler:8786 --world-size 8
    nbtrain run train.py --world-size 2 -- --epochs 3 --lr 0.1

A target without ``:FUNCTION`` that is a ``.py`` file with an ``if __name__ == "__main__":``
block is a script: every rank runs it as torchrun would, with the arguments after ``--``
(``Cluster.submit_script`` says what it gets and what needs ``ctx``).

Text progress on stdout (with the ranks' output), an HTML report at the end, and the exit
status of the job: 0 when it succeeded, 1 when it failed or was stopped, 2 for bad arguments,
130 on Ctrl-C (the job is stopped first). A function in a file is sent to the ranks by value,
so the workers need not see the file.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["load_function", "main", "parse_config"]


def load_function(target: str) -> Callable[..., Any]:
    """``path/to/file.py:name`` or ``package.module:name`` -> the function."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"expected FILE.py:FUNCTION or MODULE:FUNCTION, got {target!r}")
    import cloudpickle

    if where.endswith(".py") or os.path.sep in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise ValueError(f"no such file: {where}")
        module_name = f"nbtrain_run_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import {where} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        sys.path.insert(0, str(path.parent))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    # The ranks' workers may not see the file (or this directory): send it by value.
    cloudpickle.register_pickle_by_value(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{where} has no function {name!r}")
    return fn


def parse_config(items: Sequence[str]) -> dict[str, Any]:
    """``["lr=3e-4", "name=run1", "layers=[64,64]"]`` -> values parsed as JSON where they
    are JSON, strings otherwise."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--config takes KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nbtrain run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="FILE.py:FUNCTION or MODULE:FUNCTION, train(ctx, config); "
                                  "or SCRIPT.py, a torchrun-style script (its args after --)")
    p.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps to train (default: the function's loop decides)")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="an entry of the config passed to the function (repeatable; values "
                        "parsed as JSON when they are)")
    p.add_argument("--address", default=None,
                   help="a Dask scheduler running nbtrain's controller (default: an embedded "
                        "local cluster with --world-size workers)")
    p.add_argument("--name", default=None, help="job name (default: the function's)")
    p.add_argument("--checkpoint", default="auto",
                   help="checkpoint policy: auto, N steps, a duration like 10m, or none")
    p.add_argument("--resume", default=None, help="'latest' or a checkpoint URL")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="automatic recoveries before the job fails (default 3)")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--team", default="default")
    p.add_argument("--report", default=None,
                   help="HTML report path (default: nbtrain-report-NAME.html; '' for none)")
    return p


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """nbtrain's own arguments, and the script's (everything after the first ``--``)."""
    argv = list(argv)
    if "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return argv, []


def main(argv: Sequence[str]) -> int:
    own, script_args = _split(argv)
    args = _parser().parse_args(own)
    from nbtrain.runtime.script_work import is_script

    script = ":" not in Path(args.target).name and is_script(args.target)
    if script and (args.steps is not None or args.config or args.resume):
        print("nbtrain run: --steps, --config and --resume are for training functions; "
              f"{args.target} is a script: pass its own arguments after --", file=sys.stderr)
        return 2
    if not script and script_args:
        print(f"nbtrain run: arguments after -- are for a script, but {args.target} is not "
              "one (a .py file with an if __name__ == \"__main__\": block, no :FUNCTION)",
              file=sys.stderr)
        return 2
    fn: Callable[..., Any] | None = None
    try:
        if not script:
            fn = load_function(args.target)
        config = parse_config(args.config)
    except (ValueError, ImportError) as err:
        print(f"nbtrain run: {err}", file=sys.stderr)
        return 2
    import nbtrain
    from nbtrain.ui.dashboard import TextProgress

    checkpoint: Any = args.checkpoint
    if checkpoint in ("none", "None", "off"):
        checkpoint = None
    elif isinstance(checkpoint, str) and checkpoint.isdigit():
        checkpoint = int(checkpoint)
    name = args.name or (Path(args.target).stem if script else getattr(fn, "__name__", "train"))
    cluster = (nbtrain.connect(args.address) if args.address
               else nbtrain.connect(n_workers=args.world_size))
    with cluster:
        try:
            if fn is None:
                job = cluster.submit_script(args.target, args=script_args,
                                            world_size=args.world_size, name=name,
                                            max_restarts=args.max_restarts,
                                            priority=args.priority, team=args.team)
            else:
                job = cluster.submit(fn, world_size=args.world_size, steps=args.steps,
                                     config=config, name=name, checkpoint=checkpoint,
                                     resume=args.resume, priority=args.priority,
                                     team=args.team, max_restarts=args.max_restarts)
        except (ValueError, TypeError, PermissionError) as err:
            print(f"nbtrain run: {err}", file=sys.stderr)
            return 2
        progress = TextProgress(job)
        try:
            job.wait()
        except KeyboardInterrupt:
            print(f"nbtrain run: stopping job {job.name}", file=sys.stderr)
            job.stop()
            job.wait(120)
            progress.join(10)
            return 130
        progress.join(30)
        report = f"nbtrain-report-{job.name}.html" if args.report is None else args.report
        if report:
            print(f"report: {job.report(report)}")
        if job.status is nbtrain.JobState.SUCCEEDED:
            value = job.result() if fn is not None else None  # a script returns nothing
            if value is not None:
                print(f"result: {value!r}")
            return 0
        if job.error:
            print(job.error, file=sys.stderr)
        return 1
