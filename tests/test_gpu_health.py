"""GPU readings in straggler verdicts: the hint names the device-side cause (pure)."""

from __future__ import annotations

from typing import Any

from nbtrain.core.gpu_health import decode_reasons, device_hint, throttling
from nbtrain.core.stragglerwatch import StragglerWatch

# Readings as an H100 SXM reports them: 1.98 GHz max SM clock, 700 W limit.
HEALTHY = {"sm_clock_mhz": 1980.0, "sm_clock_max_mhz": 1980.0, "clocks_event_reasons": 0.0,
           "temperature_c": 62.0, "power_w": 640.0, "power_limit_w": 700.0,
           "ecc_uncorrected": 0.0}
HOT = {**HEALTHY, "sm_clock_mhz": 1200.0, "clocks_event_reasons": float(0x40 | 0x20),
       "temperature_c": 91.0}
CAPPED = {**HEALTHY, "sm_clock_mhz": 1605.0, "clocks_event_reasons": float(0x4),
          "power_w": 699.6}


def test_thermal_slowdown_is_named_with_clocks_and_temperature() -> None:
    assert device_hint(HOT, [HEALTHY, HEALTHY]) == (
        "GPU throttling: SM clock 1.20 GHz of 1.98 GHz max (peers at 1.98 GHz), software "
        "thermal slowdown, hardware thermal slowdown at 91 °C")


def test_a_power_cap_is_named_with_the_power_draw() -> None:
    assert device_hint(CAPPED) == ("GPU throttling: SM clock 1.60 GHz of 1.98 GHz max, "
                                   "software power cap, 700 W of a 700 W limit")


def test_a_clock_below_its_peers_counts_without_a_reason_bit() -> None:
    slow = {**HEALTHY, "sm_clock_mhz": 1410.0, "sm_clock_max_mhz": 1410.0}  # app clocks
    assert throttling(slow, [HEALTHY]) == (
        "GPU throttling: SM clock 1.41 GHz of 1.41 GHz max (peers at 1.98 GHz)")
    assert throttling(slow) == ""  # alone it is at its own maximum


def test_healthy_or_idle_readings_point_nowhere() -> None:
    assert device_hint(HEALTHY, [HEALTHY]) is None
    idle = {**HEALTHY, "sm_clock_mhz": 345.0, "clocks_event_reasons": 1.0}
    assert device_hint(idle, [HEALTHY]) is None  # sampled between kernels
    assert device_hint({}) is None


def test_gpu_errors_are_named() -> None:
    assert device_hint({**HEALTHY, "xid": 79.0}) == (
        "GPU error XID 79 (GPU has fallen off the bus)")
    assert device_hint({**HEALTHY, "ecc_uncorrected": 2.0, "xid": 1234.0}) == (
        "GPU error XID 1234; 2 uncorrected ECC errors on its GPU")


def test_reason_bits_decode_with_unknown_ones_kept() -> None:
    assert decode_reasons(0x4 | 0x80) == ["software power cap", "hardware power brake"]
    assert decode_reasons(0x1000) == ["reason 0x1000"]


def rows(slow: dict[str, float], start: int, n: int) -> dict[int, list[list[Any]]]:
    """Step rows of two ranks; rank 1's ``slow`` phase takes twice as long."""
    out: dict[int, list[list[Any]]] = {0: [], 1: []}
    for step in range(start, start + n):
        for rank in (0, 1):
            data, compute, comm, opt = 0.002, 0.040, 0.010, 0.005
            if rank == 1:
                data *= slow.get("data", 1.0)
                compute *= slow.get("compute", 1.0)
            total = data + compute + comm + opt
            out[rank].append([step, 1e9 + step, total, data, compute, comm, opt])
    return out


def verdicts(watch: StragglerWatch, slow: dict[str, float]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for start in range(1, 60, 10):
        batch = rows(slow, start, 10)
        for rank in (0, 1):
            events += watch.observe(rank, batch[rank])
    return [e for e in events if e["rank"] == 1]


def test_a_compute_straggler_on_a_hot_gpu_gets_the_device_hint() -> None:
    watch = StragglerWatch(2)
    watch.device(0, HEALTHY)
    watch.device(1, HOT)
    [suspect, *_] = verdicts(watch, {"compute": 2.0})
    assert suspect["phase"] == "compute" and suspect["state"] == "suspect"
    assert suspect["hint"].startswith("GPU throttling: SM clock 1.20 GHz of 1.98 GHz max "
                                      "(peers at 1.98 GHz)")
    assert suspect["nvml"] == HOT and "Likely GPU throttling" in suspect["summary"]


def test_a_slow_input_pipeline_keeps_its_own_hint_but_carries_the_readings() -> None:
    watch = StragglerWatch(2)
    watch.device(1, HOT)  # throttling does not explain waiting for data
    [suspect, *_] = verdicts(watch, {"data": 6.0})
    assert suspect["phase"] == "data" and suspect["hint"].startswith("input pipeline")
    assert suspect["nvml"] == HOT


def test_gpu_errors_explain_any_phase_and_no_readings_change_nothing() -> None:
    watch = StragglerWatch(2)
    watch.device(1, {**HEALTHY, "xid": 48.0})
    [suspect, *_] = verdicts(watch, {"data": 6.0})
    assert suspect["hint"] == "GPU error XID 48 (double-bit ECC error)"
    plain = StragglerWatch(2)
    [suspect, *_] = verdicts(plain, {"compute": 2.0})
    assert suspect["nvml"] is None and suspect["hint"].startswith("compute:")


def test_a_new_generation_forgets_the_readings() -> None:
    watch = StragglerWatch(2)
    watch.device(1, HOT)
    watch.restart(2, 0)
    [suspect, *_] = verdicts(watch, {"compute": 2.0})
    assert suspect["nvml"] is None
