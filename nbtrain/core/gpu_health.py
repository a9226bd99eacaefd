"""What a GPU's NVML readings say about a slow rank (pure).

A rank on a GPU samples NVML now and then (``nbtrain.runtime.nvml.DeviceMonitor``): SM clock
and its maximum, the clock event (throttle) reasons, temperature, power and its limit,
uncorrected ECC errors, the last critical XID. When the straggler detector blames that rank,
the verdict carries its latest readings, and :func:`device_hint` turns them, compared with the
other ranks' readings, into the likely cause: "SM clock 1.20 GHz of 1.98 GHz max (peers at
1.98 GHz): hardware thermal slowdown at 91 °C" says more than "thermal or power throttling".

Readings are ``{name: float}`` with the keys in :data:`READINGS`; any may be missing (NVML
answers what the GPU supports).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

__all__ = ["CLOCK_EVENT_REASONS", "READINGS", "XID_MEANINGS", "decode_reasons", "device_errors",
           "device_hint", "throttling"]

READINGS = ("sm_clock_mhz", "sm_clock_max_mhz", "clocks_event_reasons", "temperature_c",
            "power_w", "power_limit_w", "ecc_uncorrected", "xid", "gpu_util_pct")

#: ``nvmlClocksEventReason*`` bits (formerly ``nvmlClocksThrottleReason*``).
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "idle",
    0x2: "application clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}
#: Reasons that lower clocks without making one rank slower than its peers.
_BENIGN = 0x1 | 0x2 | 0x10 | 0x100
_THERMAL = 0x20 | 0x40
_POWER = 0x4 | 0x80

#: Critical XIDs worth naming (NVIDIA's XID catalogue).
XID_MEANINGS: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after an earlier error",
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

#: A clock this far under its maximum, or under the peers' median, counts as throttled.
_SLOW_CLOCK = 0.9


def decode_reasons(mask: float | int) -> list[str]:
    """The names of the clock event reason bits set in ``mask``, lowest bit first."""
    bits = int(mask)
    named = [name for bit, name in CLOCK_EVENT_REASONS.items() if bits & bit]
    unknown = bits & ~sum(CLOCK_EVENT_REASONS)
    return named + ([f"reason 0x{unknown:x}"] if unknown else [])


def device_hint(mine: Mapping[str, float],
                peers: Sequence[Mapping[str, float]] = ()) -> str | None:
    """The likely device-side cause of a slow rank from its readings and its peers', or None
    when nothing in them stands out."""
    parts = device_errors(mine)
    throttle = throttling(mine, peers)
    if throttle:
        parts.append(throttle)
    return "; ".join(parts) or None


def device_errors(mine: Mapping[str, float]) -> list[str]:
    """Errors of the GPU itself (a critical XID, uncorrected ECC errors): they explain a slow
    rank whatever phase is slow."""
    parts: list[str] = []
    xid = int(mine.get("xid", 0))
    if xid:
        meaning = XID_MEANINGS.get(xid)
        parts.append(f"GPU error XID {xid}" + (f" ({meaning})" if meaning else ""))
    ecc = int(mine.get("ecc_uncorrected", 0))
    if ecc > 0:
        parts.append(f"{ecc} uncorrected ECC error{'s' if ecc != 1 else ''} on its GPU")
    return parts


def throttling(mine: Mapping[str, float], peers: Sequence[Mapping[str, float]] = ()) -> str:
    """"GPU throttling: ..." when the SM clock is held down (a throttle reason, or the clock
    under 90% of its maximum or of the peers' median); "" otherwise. It explains slow
    device work (compute, the optimizer step), not slow input or network."""
    mask = int(mine.get("clocks_event_reasons", 0)) & ~_BENIGN
    clock = mine.get("sm_clock_mhz")
    top = mine.get("sm_clock_max_mhz")
    peer_clocks = [p["sm_clock_mhz"] for p in peers if "sm_clock_mhz" in p]
    peer_clock = statistics.median(peer_clocks) if peer_clocks else None
    # A sample taken while the GPU idled (between kernels) shows idle clocks, not throttling.
    idle = bool(int(mine.get("clocks_event_reasons", 0)) & 0x1)
    slow = clock is not None and not idle and (
        (top is not None and top > 0 and clock < _SLOW_CLOCK * top)
        or (peer_clock is not None and clock < _SLOW_CLOCK * peer_clock))
    if not mask and not slow:
        return ""
    text = "GPU throttling"
    if clock is not None:
        text += f": SM clock {clock / 1e3:.2f} GHz"
        if top:
            text += f" of {top / 1e3:.2f} GHz max"
        if peer_clock is not None:
            text += f" (peers at {peer_clock / 1e3:.2f} GHz)"
    if mask:
        text += (": " if clock is None else ", ") + ", ".join(decode_reasons(mask))
    temp = mine.get("temperature_c")
    if mask & _THERMAL and temp is not None:
        text += f" at {temp:.0f} °C"
    power, limit = mine.get("power_w"), mine.get("power_limit_w")
    if mask & _POWER and power is not None:
        text += f", {power:.0f} W" + (f" of a {limit:.0f} W limit" if limit else "")
    return text
