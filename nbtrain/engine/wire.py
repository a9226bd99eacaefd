"""What crosses between a client and the controller: plain dicts, and errors with their kind.

Dask's RPC carries msgpack-friendly values. A submission travels as a dict of plain values
(the recipe as the bytes the client pickled), rebuilt into typed objects on the scheduler's
side; replies are ``{"ok": True, ...}`` or ``{"ok": False, "error": kind, "message": ...}``,
raised on the client as the exception class the kind names.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from nbtrain.core.faults import Fault
from nbtrain.core.job import JobSpec
from nbtrain.core.lifecycle_types import JobPolicy, JobSubmission
from nbtrain.core.mitigation import MitigationSettings

__all__ = ["ERRORS", "ControllerError", "error_reply", "plain", "raise_for",
           "submission_from_wire", "submission_to_wire"]


class ControllerError(RuntimeError):
    """The controller failed to answer (a bug or an unreachable scheduler), with its words."""


#: Error kinds a reply may carry, and the exception a client raises for each.
ERRORS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "PermissionError": PermissionError,
    "LookupError": LookupError,
    "TypeError": TypeError,
    "RuntimeError": ControllerError,
}


def plain(obj: Any) -> Any:
    """A dataclass, enum or container as plain msgpack-friendly values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return plain(obj.value)
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain(v) for v in obj]
    return obj


def error_reply(exc: BaseException) -> dict[str, Any]:
    kind = next((name for name, cls in ERRORS.items() if isinstance(exc, cls)), "RuntimeError")
    return {"ok": False, "error": kind, "message": str(exc)}


def raise_for(reply: Mapping[str, Any]) -> Mapping[str, Any]:
    """Return a successful reply; raise the error a failed one names."""
    if reply.get("ok"):
        return reply
    cls = ERRORS.get(str(reply.get("error")), ControllerError)
    raise cls(str(reply.get("message", "the nbtrain controller gave no reason")))


def submission_to_wire(sub: JobSubmission) -> dict[str, Any]:
    out: dict[str, Any] = plain(sub)
    return out


def submission_from_wire(data: Mapping[str, Any]) -> JobSubmission:
    spec = dict(data["spec"])
    return JobSubmission(
        spec=JobSpec(**spec),
        owner=str(data.get("owner", "")),
        policy=JobPolicy(**data.get("policy", {})),
        mitigation=MitigationSettings(**data.get("mitigation", {})),
        faults=tuple(Fault.from_dict(f) for f in data.get("faults", ())),
        resume_step=int(data.get("resume_step", 0)),
        knob_history=_knob_history(data.get("knob_history", ())),
    )


def _knob_history(history: Any) -> tuple[dict[str, Any], ...]:
    """A replay's applied knob changes, checked (KnobError, a ValueError, names the fix)."""
    from nbtrain.core.knobs import KnobBook

    if not isinstance(history, list | tuple):
        raise TypeError(f"knob_history must be a list of applied changes, got "
                        f"{type(history).__name__}")
    return tuple(c.to_dict() for c in KnobBook.replaying(history).history)
