"""The controller's handlers: what clients and ranks call on the Dask scheduler.

Clients: ``nbtrain_submit``, ``nbtrain_request``, ``nbtrain_follow`` (long-poll for a job's
new rows, events and status), ``nbtrain_jobs``, ``nbtrain_job``, ``nbtrain_cluster``. Ranks:
``nbtrain_rendezvous`` and ``nbtrain_control`` (long-polls). Every reply is a dict with
``ok``; failures carry the error's kind (:mod:`nbtrain.engine.wire`), so a refused request
is a clear exception on the client, not a traceback in the scheduler's log.

Ownership: ``submit`` returns a random token; a request on a job must carry that token or
the operator's, and reads follow :mod:`nbtrain.engine.access` (results and logs: the owner's
and the operator's; metrics and status: by the cluster's ``visibility``). Ranks show their
generation's secret (:mod:`nbtrain.core.rankseal`). This keeps the users of a shared cluster
apart through nbtrain's own calls; it cannot stop a client that runs code in the scheduler or
the workers with Dask's own API (see the README's threat model).
"""

from __future__ import annotations

import asyncio
import functools
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nbtrain.config import CLIENT_ONLY, Settings
from nbtrain.core.clusterevents import cluster_log_lines
from nbtrain.core.explain import resume_rejected
from nbtrain.core.job import JobState
from nbtrain.core.jobevents import state_event
from nbtrain.core.lifecycle_types import Rejected, Submitted
from nbtrain.core.machine_events import REQUEST_KINDS, request_from_wire
from nbtrain.core.teamshare import jobs_per_student, team_shares, waiting_jobs
from nbtrain.engine import rank_handlers
from nbtrain.engine.access import (
    Role,
    may_read_metrics,
    public_event,
    refusal,
    role_of,
    shown_status,
)
from nbtrain.engine.joblog import JobLog
from nbtrain.engine.wire import error_reply, submission_from_wire

if TYPE_CHECKING:
    from nbtrain.engine.port import ControllerPort

__all__ = ["install"]

#: Requests a job's owner (or the operator) may make.
REQUESTS = REQUEST_KINDS
#: Largest argument of a request (as JSON): a knob change or detector settings.
REQUEST_ARG_MAX_BYTES = 64 << 10
#: After the first news, a follower waits this long so rows of all ranks come in one reply...
FOLLOW_BATCH_S = 0.02
#: ... and this long when only step rows or output lines are new (``_settle``).
FOLLOW_ROWS_S = 0.25
#: The most jobs one follow call may ask about, and rows it may get per job.
FOLLOW_JOBS_MAX = 1_000
FOLLOW_ROWS_MAX = 20_000
#: Largest submission (the job's spec and options as sent, without the recipe), and the most
#: trackers a job may have.
SUBMISSION_MAX_BYTES = 1 << 20
TRACKERS_MAX = 8
#: Far past any log's end: a cursor there asks for nothing (a part the caller may not read).
NOTHING = 1 << 62


def install(ctl: ControllerPort, scheduler: Any) -> None:
    """Register the handlers on the scheduler (replacing any of an older controller)."""
    table: dict[str, Callable[..., Awaitable[dict[str, Any]]]] = {
        "nbtrain_submit": functools.partial(submit, ctl),
        "nbtrain_request": functools.partial(request, ctl),
        "nbtrain_follow": functools.partial(follow, ctl),
        "nbtrain_jobs": functools.partial(jobs, ctl),
        "nbtrain_job": functools.partial(job, ctl),
        "nbtrain_cluster": functools.partial(cluster, ctl),
        "nbtrain_view": functools.partial(view, ctl),
        "nbtrain_result": functools.partial(result, ctl),
        "nbtrain_rendezvous": functools.partial(rank_handlers.rendezvous, ctl),
        "nbtrain_control": functools.partial(rank_handlers.control, ctl),
        "nbtrain_autoscale": functools.partial(autoscale, ctl),
    }
    for name, fn in table.items():
        scheduler.handlers[name] = _replying(fn)


def _replying(fn: Callable[..., Awaitable[dict[str, Any]]]
              ) -> Callable[..., Awaitable[dict[str, Any]]]:
    async def handler(**kwargs: Any) -> dict[str, Any]:
        try:
            return {"ok": True, **(await fn(**kwargs))}
        except (ValueError, PermissionError, LookupError, TypeError) as exc:
            return error_reply(exc)
        except Exception as exc:  # a controller bug: say so, keep the scheduler running
            import logging

            logging.getLogger(__name__).exception("nbtrain handler failed")
            return error_reply(RuntimeError(f"nbtrain controller error: "
                                            f"{type(exc).__name__}: {exc}"))

    handler.__name__ = getattr(fn, "__name__", "nbtrain_handler")
    return handler


# ====================================================================== cluster managers
async def autoscale(ctl: ControllerPort, *, minimum: int = 0, maximum: int | None = None,
                    idle_s: float = 60.0, kind: str = "cpu") -> dict[str, Any]:
    """nbtrain's adaptive policy (:mod:`nbtrain.core.autoscale`) for a cluster manager:
    ``target`` workers, the ``retire`` names that may go, the jobs ``asked`` for and the
    ``reasons``, and the names of workers that announced they leave and have gone since the
    last call (``departed``: for the cluster manager to drop from its plan)."""
    from nbtrain.core.autoscale import AutoscaleSettings

    d = ctl.autoscale(AutoscaleSettings(minimum=int(minimum),
                                        maximum=None if maximum is None else int(maximum),
                                        idle_s=float(idle_s), kind=str(kind)))
    departed = ctl.take_departed()
    return {"target": d.target, "retire": list(d.retire), "asked": list(d.asked),
            "reserved": d.reserved, "reasons": list(d.reasons), "departed": departed}


# ====================================================================== clients
async def submit(ctl: ControllerPort, *, job: Mapping[str, Any], recipe: bytes,
                 settings: Mapping[str, Any], checkpoint_url: str,
                 restore: list[Any] | None = None, token: str = "",
                 trackers: list[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    from nbtrain.engine.assets import JobAssets, token_hash

    _check_size(job, settings, trackers)
    sub = submission_from_wire(job)
    spec = sub.spec
    operator = _is_operator(ctl, token)
    ceiling = ctl.settings.priority_ceiling
    if spec.priority > ceiling and not operator:
        raise PermissionError(
            f"job {spec.name}: priority {spec.priority} is above this cluster's ceiling "
            f"{ceiling}; only the operator may submit above it (connect with its "
            "operator_token), or use a priority <= "
            f"{ceiling}")
    if spec.job_id in ctl.assets:
        raise ValueError(f"job id {spec.job_id!r} is already in use; submit under a new id")
    live = ctl.live_jobs()
    if live >= ctl.settings.jobs_max:
        raise ValueError(f"job {spec.name}: this cluster already holds {live:,} jobs that are "
                         f"queued, held or running (its jobs_max is "
                         f"{ctl.settings.jobs_max:,}); wait for some to end, or stop ones you "
                         "no longer need")
    limit = ctl.settings.recipe_max_bytes
    if len(recipe) > limit:
        raise ValueError(
            f"job {spec.name}: its pickled recipe or training function is {len(recipe):,} "
            f"bytes, more than this cluster's recipe_max_bytes ({limit:,}); it carries the "
            "config and the globals the function uses: load big data inside the function "
            "(from a path or URL) instead of capturing it")
    job_token = secrets.token_hex(16)
    restore_at = ((str(restore[0]), None if restore[1] is None else int(restore[1]))
                  if restore else None)
    # A client's own values (an older client sent its operator token) stay out of the job.
    settings = {k: v for k, v in dict(settings).items() if k not in CLIENT_ONLY}
    assets = ctl.assets[spec.job_id] = JobAssets(
        spec=spec, recipe=bytes(recipe), settings=Settings.from_dict(settings),
        checkpoint_url=checkpoint_url, restore=restore_at, token_hash=token_hash(job_token),
        log=ctl.job_log(spec.job_id))
    if trackers:
        ctl.attach_trackers(assets, list(trackers))
    # Journaled before the machine sees it (so its first events have a job to belong to),
    # dropped again if the machine rejects it.
    ctl.store.add_job(job_id=spec.job_id, name=spec.name, submission=job, recipe=assets.recipe,
                      settings=dict(settings), checkpoint_url=checkpoint_url,
                      restore=restore_at, token_hash=assets.token_hash,
                      trackers=list(trackers) if trackers else None,
                      status={"state": "QUEUED"})
    now, wall = ctl.now()
    commands = ctl.feed(Submitted(now, wall, sub))
    rejected = [c for c in commands if isinstance(c, Rejected) and c.job_id == spec.job_id]
    if rejected:
        held = ctl.assets.pop(spec.job_id, None)
        ctl.store.drop_job(spec.job_id)
        if held is not None and held.trackers is not None:
            held.trackers.event(dict(state_event(wall, "CANCELLED", rejected[0].reason)))
        raise ValueError(rejected[0].reason)
    ctl.journal_status(spec.job_id)
    await ctl.journaled()  # recorded before acknowledged
    return {"job_id": spec.job_id, "token": job_token, "status": ctl.job_status(spec.job_id)}


async def request(ctl: ControllerPort, *, job_id: str, what: str, arg: Any = None,
                  token: str = "") -> dict[str, Any]:
    status = _known(ctl, job_id)
    if what in REQUESTS:
        check_owner(ctl, job_id, token, what, status)
    if what == "set" and isinstance(arg, Mapping):  # who changed it: the controller says
        role = role_of(ctl, job_id, token)
        arg = {**arg, "who": "operator" if role is Role.OPERATOR
               else str(status.get("owner") or "owner")}
    after = apply_request(ctl, job_id, what, arg)
    ctl.journal_status(job_id)
    await ctl.journaled()  # recorded before acknowledged
    return {"status": after}


def check_owner(ctl: ControllerPort, job_id: str, token: str, what: str,
                status: Mapping[str, Any] | None = None) -> None:
    """PermissionError unless ``token`` is the job's or the operator's."""
    status = status or _known(ctl, job_id)
    if role_of(ctl, job_id, token) is Role.OTHER:
        owner = status["owner"] or "another client"
        raise PermissionError(
            f"job {status['name']} ({job_id}) belongs to {owner}: only the handle that "
            f"submitted it, a client holding its token, or the cluster's operator may "
            f"{what} it")


def apply_request(ctl: ControllerPort, job_id: str, what: str, arg: Any = None
                  ) -> dict[str, Any]:
    """A user's request on a job whose ownership was checked (by token, or by a view's
    ticket): validated, fed to the job machine; the job's status after it. Raises
    ValueError/TypeError with the fix for a request the job cannot take."""
    if what not in REQUESTS:
        raise ValueError(f"unknown request {what!r}; one of {', '.join(REQUESTS)}")
    status = _known(ctl, job_id)
    _check_arg_size(what, arg)
    if ctl.assets[job_id].final is not None:  # ended before this controller started
        if what == "resume":
            raise ValueError(resume_rejected(str(status["name"]), JobState(status["state"])))
        if what == "set":
            raise ValueError(f"job {status['name']} has ended ({status['state']}): its knobs "
                             "can no longer change; cluster.submit(..., replay=job) runs it "
                             "again with the changes it had")
        return status
    # Read here, once, into the machine's typed event (a field it cannot read raises);
    # judged (the rank's bound, whether the job may resume) by the machine.
    now, wall = ctl.now()
    commands = ctl.feed(request_from_wire(now, wall, job_id, what, arg))
    rejected = [c for c in commands if isinstance(c, Rejected) and c.job_id == job_id]
    if rejected:
        raise ValueError(rejected[0].reason)
    after = ctl.job_status(job_id)
    assert after is not None  # the machine holds it: the request was fed to it
    return after


async def _settle(ctl: ControllerPort, cursors: Mapping[str, Sequence[int]],
                  deadline: float) -> None:
    """A follow call has news: wait ``FOLLOW_BATCH_S`` so that the other ranks' rows come
    in the same reply. With only step rows or output lines new, wait on until
    ``FOLLOW_ROWS_S`` after the news, so that a running job's followers are answered a few
    times a second, not once per rank message; an event (a state change, an alert, a
    checkpoint) or a job gone ends that wait at once. Never past ``deadline``."""
    loop = asyncio.get_running_loop()
    until = min(deadline, loop.time() + FOLLOW_ROWS_S)
    await asyncio.sleep(max(0.0, min(FOLLOW_BATCH_S, until - loop.time())))
    while not _event_news(ctl, cursors) and (left := until - loop.time()) > 0:
        try:
            await asyncio.wait_for(ctl.news.wait(), left)
        except TimeoutError:
            return


def _event_news(ctl: ControllerPort, cursors: Mapping[str, Sequence[int]]) -> bool:
    """Whether a followed job has events past its cursor, or is gone."""
    return any(jid not in ctl.assets or ctl.assets[jid].log.events.end > c[1]
               for jid, c in cursors.items())


async def follow(ctl: ControllerPort, *, cursors: Mapping[str, list[int]],
                 timeout: float = 2.0, max_rows: int = FOLLOW_ROWS_MAX, token: str = "",
                 tokens: Mapping[str, str] | None = None) -> dict[str, Any]:
    """New rows, events and output lines of the followed jobs (cursors: positions of the
    next row, event and line; a negative row cursor -n: the newest n rows), and their
    status. Returns as soon as any has news (after a short pause that batches what arrives
    together: ``FOLLOW_ROWS_S`` when only rows or output lines are new, see ``_settle``), or
    after ``timeout`` seconds with the statuses alone.

    ``tokens``: the caller's token per job, ``token`` its operator token: what it may read
    of each job (:mod:`nbtrain.engine.access`); ``refused`` in a job's reply names what it
    may not, and why."""
    cursors = _checked_cursors(cursors)
    tokens = dict(tokens or {})
    roles = {jid: _role(ctl, jid, tokens.get(jid), token) for jid in cursors}
    cursors = {jid: _readable(ctl, roles[jid], _from_newest(ctl, jid, c))
               for jid, c in cursors.items()}
    max_rows = max(0, min(int(max_rows), FOLLOW_ROWS_MAX))
    timeout = min(float(timeout), 60.0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, float(timeout))
    while True:
        news = {jid: c for jid, c in cursors.items()
                if jid in ctl.assets and ctl.assets[jid].log.has_news(*c)}
        gone = [jid for jid in cursors if jid not in ctl.assets]
        remaining = deadline - loop.time()
        if news or gone or remaining <= 0:
            break
        waiter = ctl.news
        try:
            await asyncio.wait_for(waiter.wait(), remaining)
        except TimeoutError:
            continue
    if news:
        await _settle(ctl, cursors, deadline)
    out: dict[str, Any] = {}
    for jid, cursor in cursors.items():
        assets = ctl.assets.get(jid)
        if assets is None:  # an ended job no longer in memory: read it back
            stored = await asyncio.to_thread(ctl.store.job, str(jid))
            if stored is not None and stored.job_id == jid:
                try:
                    assets = ctl.archive(stored)
                except Exception:  # one unreadable record must not fail the whole reply
                    import logging

                    logging.getLogger(__name__).exception("nbtrain: reading back job %s", jid)
        status = ctl.job_status(jid) if assets is not None else None
        if assets is None or status is None:
            out[jid] = {"gone": True}
            continue
        role = roles[jid] or role_of(ctl, jid, tokens.get(jid), token)  # (read back)
        rows_from, events_from, output_from = _readable(ctl, role, cursor)
        update = assets.log.since(rows_from, events_from, max_rows, output_from)
        await _older_from_store(ctl, jid, assets.log, update,
                                {"rows": rows_from, "events": events_from,
                                 "output": output_from}, max_rows)
        _withhold(ctl, role, status, update)
        update["status"] = shown_status(ctl, status, role)
        out[jid] = update
    return {"jobs": out}


def _check_arg_size(what: str, arg: object) -> None:
    """ValueError when a request's argument is bigger than any real one (before parsing)."""
    import json

    try:
        size = len(json.dumps(arg, default=str))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the argument of {what} must be plain data (JSON-able): {exc}") from None
    if size > REQUEST_ARG_MAX_BYTES:
        raise ValueError(f"the argument of {what} is {size:,} bytes as JSON, more than "
                         f"{REQUEST_ARG_MAX_BYTES:,}")


def _check_size(job: object, settings: object, trackers: object) -> None:
    """ValueError when a submission is bigger than any real one (bounded before parsing)."""
    import json

    # (Dask's messages turn lists into tuples on the way)
    if trackers is not None and (not isinstance(trackers, list | tuple)
                                 or len(trackers) > TRACKERS_MAX):
        what = len(trackers) if isinstance(trackers, list | tuple) else repr(trackers)
        raise ValueError(f"a job may have at most {TRACKERS_MAX} trackers (a list), got {what}")
    try:
        size = len(json.dumps([job, settings, trackers], default=str))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a submission must be plain data (JSON-able): {exc}") from None
    if size > SUBMISSION_MAX_BYTES:
        raise ValueError(f"the submission is {size:,} bytes without its recipe, more than "
                         f"{SUBMISSION_MAX_BYTES:,}: large values belong in the training "
                         "function's config (recipe_max_bytes) or in storage")


def _checked_cursors(cursors: object) -> dict[str, list[int]]:
    """A follow call's cursors, or TypeError/ValueError saying what is wrong (bounded)."""
    if not isinstance(cursors, Mapping):
        raise TypeError(f"cursors must map job ids to positions, got {type(cursors).__name__}")
    if len(cursors) > FOLLOW_JOBS_MAX:
        raise ValueError(f"a follow call may ask about at most {FOLLOW_JOBS_MAX:,} jobs, got "
                         f"{len(cursors):,}")
    out: dict[str, list[int]] = {}
    for jid, cursor in cursors.items():
        if (not isinstance(cursor, list | tuple) or not 2 <= len(cursor) <= 3
                or not all(isinstance(c, int) and not isinstance(c, bool) for c in cursor)):
            raise TypeError(f"the cursor of job {jid!r} must be 2 or 3 integers (rows, events, "
                            f"output), got {cursor!r}")
        out[str(jid)] = [*cursor, 0][:3]
    return out


def _role(ctl: ControllerPort, job_id: str, *tokens: object) -> Role | None:
    """The caller's role for a job in memory (None: not in memory now)."""
    return role_of(ctl, job_id, *tokens) if job_id in ctl.assets else None


def _readable(ctl: ControllerPort, role: Role | None, cursor: list[int]) -> list[int]:
    """``cursor`` with the parts the caller may not read moved past any end."""
    rows, events, output = cursor
    if role is Role.OTHER:
        output = NOTHING
        if not may_read_metrics(ctl, role):
            rows = events = NOTHING
    return [rows, events, output]


def _withhold(ctl: ControllerPort, role: Role, status: Mapping[str, Any],
              update: dict[str, Any]) -> None:
    """Drop from a follow reply what the caller may not read, and say why."""
    if role is not Role.OTHER:
        return
    hidden = ["output"] if may_read_metrics(ctl, role) else ["rows", "events", "output"]
    if "events" in update and "events" not in hidden:
        update["events"] = [public_event(e) for e in update["events"]]
    for part in hidden:
        for key in (part, f"{part}_at", f"{part}_end"):
            update.pop(key, None)
    what = {"rows": "metrics", "events": "events", "output": "logs"}
    update["refused"] = {part: str(refusal(status, what[part])) for part in hidden}


def _from_newest(ctl: ControllerPort, job_id: str, cursor: list[int]) -> list[int]:
    if cursor and int(cursor[0]) < 0 and job_id in ctl.assets:
        cursor[0] = max(0, ctl.assets[job_id].log.rows.end + int(cursor[0]))
    return cursor


async def _older_from_store(ctl: ControllerPort, job_id: str, log: JobLog,
                            update: dict[str, Any], cursors: Mapping[str, int],
                            max_rows: int) -> None:
    """Positions a follower asks for that memory no longer holds come from the journal
    (read on a thread: the loop never waits on the disk), once everything added so far is
    committed: the writer may still be gathering the newest rows (``store.GATHER_S``)."""
    tails = {"rows": log.rows, "events": log.events, "output": log.output}
    older = {table: tail for table, tail in tails.items() if int(cursors[table]) < tail.base}
    if older:
        await ctl.journaled()
    for table, tail in older.items():
        start = int(cursors[table])
        limit = min(tail.base - start, max_rows if table == "rows" else 10_000)
        at, items = await asyncio.to_thread(ctl.store.history, table, job_id, start, limit)
        if items:
            update[f"{table}_at"] = at
            update[table] = [tuple(x) for x in items] if table == "rows" else items


async def jobs(ctl: ControllerPort, *, token: str = "",
               tokens: Mapping[str, str] | None = None) -> dict[str, Any]:
    return {"jobs": _listing(ctl, token, tokens)}


def _listing(ctl: ControllerPort, token: str = "",
             tokens: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Every job in memory as the caller may see it (``tokens``: its token per job)."""
    tokens = tokens if isinstance(tokens, Mapping) else {}
    out = []
    for jid in ctl.job_ids():
        status = ctl.job_status(jid)
        if status is not None:
            out.append(shown_status(ctl, status, role_of(ctl, jid, tokens.get(jid), token)))
    return out


async def job(ctl: ControllerPort, *, key: str, token: str = "", operator: str = ""
              ) -> dict[str, Any]:
    """One job by id, or the newest job of that name: what a client needs to attach
    (an old ended job is read back from the journal). Where its checkpoints are only for
    its owner and the operator."""
    if not isinstance(key, str) or not key or len(key) > 200:
        raise ValueError(f"a job is named by its id or name (a string of 1 to 200 "
                         f"characters), got {key!r}")
    ids = ctl.job_ids()
    if key not in ids:
        named = [jid for jid in ids if ctl.assets.get(jid) and ctl.assets[jid].spec.name == key]
        if named:
            key = named[-1]
        else:
            stored = await asyncio.to_thread(ctl.store.job, str(key))
            if stored is None:
                names = sorted({ctl.assets[j].spec.name for j in ids if j in ctl.assets})
                raise LookupError(f"no job with id or name {key!r} on this cluster; its "
                                  f"jobs: {', '.join(names[-20:]) or 'none'}")
            key = stored.job_id
            if key not in ctl.assets:
                ctl.archive(stored)
    assets = ctl.assets[key]
    from nbtrain.engine.wire import plain

    role = role_of(ctl, key, token, operator)
    status = ctl.job_status(key) or {}
    spec = plain(assets.spec)
    if role is Role.OTHER:
        spec["resume"] = None  # a checkpoint location too
    return {"job_id": key, "spec": spec,
            "checkpoint_url": "" if role is Role.OTHER else assets.checkpoint_url,
            "status": shown_status(ctl, status, role)}


async def result(ctl: ControllerPort, *, job_id: str, token: str = "", operator: str = ""
                 ) -> dict[str, Any]:
    """A training function's return value on rank 0 (pickled bytes, None if it returned
    nothing), or why there is none: for the job's owner and the operator only."""
    status = _known(ctl, job_id)
    if role_of(ctl, job_id, token, operator) is Role.OTHER:
        raise refusal(status, "result")
    assets = ctl.assets[job_id]
    if assets.final is not None and assets.result is None and assets.result_error is None:
        assets.result, assets.result_error = await asyncio.to_thread(ctl.store.result, job_id)
    return {"result": assets.result, "error": assets.result_error}


async def cluster(ctl: ControllerPort, *, log_from: int = 0, token: str = "",
                  tokens: Mapping[str, str] | None = None) -> dict[str, Any]:
    return cluster_snapshot(ctl, int(log_from), token, tokens)


def cluster_snapshot(ctl: ControllerPort, log_from: int = 0, token: str = "",
                     tokens: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Slots, queue, jobs (as the caller may see them), team usage and the cluster's log
    (what ``Cluster.snapshot()`` and the class view show)."""
    at, log = ctl.cluster_log.since(log_from, 1_000)
    jobs = _listing(ctl, token, tokens)
    queue = ctl.queue()
    window_s, window = ctl.team_window()
    return {"slots": ctl.slots(), "queue": queue,
            "pending_workers": ctl.pending_workers,
            "jobs": jobs,
            "team_usage": ctl.team_usage(),
            # what a teacher reads (the class page's tables): nbtrain.core.teamshare
            "share_window_s": window_s, "teams": team_shares(window, jobs),
            "waiting": waiting_jobs(jobs, queue), "students": jobs_per_student(jobs),
            "log_at": at, "log": log, "log_lines": cluster_log_lines(log, jobs),
            "decision_ms": ctl.decision_ms()}


async def view(ctl: ControllerPort, *, job_id: str | None = None,
               token: str = "") -> dict[str, Any]:
    """Where a live page is: the class view, or a job's page with a ticket for its controls
    when ``token`` is the job's or the operator's (else read-only). ``served``: "dashboard" or
    "attached" when the scheduler serves the pages, "none" when it cannot."""
    from nbtrain.engine.tickets import PAGE_CLUSTER, PAGE_JOB, issue_ticket, page_path

    served = ctl.pages
    if job_id is None:
        return {"path": page_path(PAGE_CLUSTER), "served": served, "controls": False}
    _known(ctl, job_id)
    try:
        check_owner(ctl, job_id, token, "steer")
        ticket = issue_ticket(ctl, job_id)
    except PermissionError:
        ticket = ""
    return {"path": page_path(PAGE_JOB, job=job_id, ticket=ticket), "served": served,
            "controls": bool(ticket)}


# ====================================================================== helpers
def _known(ctl: ControllerPort, job_id: str) -> dict[str, Any]:
    status = ctl.job_status(job_id) if job_id in ctl.assets else None
    if status is None:
        raise LookupError(f"no job {job_id!r} on this cluster's controller now (ended jobs "
                          f"leave its memory after {ctl.settings.jobs_kept} more have ended: "
                          "cluster.job(name_or_id) reads them back from its state directory)")
    return status


def _is_operator(ctl: ControllerPort, token: str) -> bool:
    from nbtrain.engine.assets import token_matches

    return token_matches(token, ctl.operator_hash)
