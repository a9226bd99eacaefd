"""Reading GPUs on a worker: NVML through nvidia-ml-py, or the ``nvidia-smi`` command.

Two uses, both torch-free (the scheduler imports this module's names to run them remotely):

- **Discovery** (:func:`discover`, at a worker's join): every GPU of the host, with NVLink
  link ends and NVLink fabric (clique) info, as raw NVML values; the pure
  :mod:`nbtrain.core.gpu_topology` turns them into NVLink domain labels. Without
  nvidia-ml-py (``pip install nbtrain[gpu]``) the text of ``nvidia-smi -q`` and
  ``nvidia-smi topo -m`` stands in.
- **Health** (:class:`DeviceMonitor`, in a rank): SM clock against its maximum, clock event
  (throttle) reasons, temperature, power, uncorrected ECC errors and the last critical XID,
  sampled at a low rate and sent as ``device`` events; the straggler verdicts carry them.

Every NVML call that a driver or GPU may not support is answered by leaving that value out,
never by failing the worker or the rank.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import uuid as uuidlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from nbtrain.core.gpu_topology import (
    HostGpus,
    gpus_from_nvidia_smi,
    gpus_from_nvml,
    normalize_bus_id,
)

__all__ = ["DeviceMonitor", "discover", "monitor_device", "read_health", "read_nvidia_smi",
           "read_nvml"]

#: Seconds allowed for one ``nvidia-smi`` call (it can hang on a GPU in a bad state).
NVIDIA_SMI_TIMEOUT_S = 20.0
_MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS in nvidia-ml-py 12+; older drivers answer fewer


def _pynvml() -> Any | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    return pynvml


def _try(call: Callable[[], Any]) -> Any:
    """``call()``, or None when NVML says the driver or GPU cannot answer it."""
    try:
        return call()
    except Exception:  # NVMLError_NotSupported, _FunctionNotFound, _NoPermission, ...
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_nvml(nvml: Any | None = None) -> dict[str, Any] | None:
    """Raw NVML readings of every GPU of this host (the format ``gpus_from_nvml`` reads);
    None without nvidia-ml-py or without a driver."""
    nvml = nvml or _pynvml()
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
    except Exception:  # no driver, no GPU: a CPU worker
        return None
    try:
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            pci = nvml.nvmlDeviceGetPciInfo(handle)
            gpus.append({
                "index": index,
                "uuid": _text(nvml.nvmlDeviceGetUUID(handle)),
                "pci_bus_id": normalize_bus_id(_text(pci.busId)),
                "name": _text(_try(partial(nvml.nvmlDeviceGetName, handle)) or ""),
                "nvlinks": list(_nvlinks(nvml, handle)),
                "fabric": _fabric(nvml, handle),
            })
        driver = _try(nvml.nvmlSystemGetDriverVersion)
        return {"gpus": gpus, "driver": _text(driver or "")}
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _nvlinks(nvml: Any, handle: Any) -> Iterator[dict[str, Any]]:
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", _MAX_LINKS)):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except Exception:
            # PCIe-only GPUs answer Not Supported for link 0; others Invalid Argument past
            # their last link.
            return
        entry: dict[str, Any] = {"link": link, "state": int(state)}
        if state:
            kind = _try(partial(nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link))
            entry["remote_device_type"] = 0xFF if kind is None else int(kind)
            remote = _try(partial(nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link))
            entry["remote_pci_bus_id"] = (normalize_bus_id(_text(remote.busId))
                                          if remote is not None else "")
        yield entry


def _fabric(nvml: Any, handle: Any) -> dict[str, Any] | None:
    """``nvmlDeviceGetGpuFabricInfoV`` (the versioned call), else the older one; None when the
    GPU has no NVLink fabric (Not Supported)."""
    info = None
    struct = getattr(nvml, "c_nvmlGpuFabricInfoV_t", None)
    if struct is not None:
        candidate = struct()
        if _try(lambda: nvml.nvmlDeviceGetGpuFabricInfoV(handle, candidate)) is not None:
            info = candidate
    if info is None and hasattr(nvml, "c_nvmlGpuFabricInfo_t"):
        candidate = nvml.c_nvmlGpuFabricInfo_t()
        if _try(lambda: nvml.nvmlDeviceGetGpuFabricInfo(handle, candidate)) is not None:
            info = candidate
    if info is None:
        return None
    return {"cluster_uuid": str(uuidlib.UUID(bytes=bytes(info.clusterUuid))),
            "clique_id": int(info.cliqueId), "state": int(info.state),
            "status": int(info.status)}


def read_nvidia_smi() -> tuple[str, str] | None:
    """The text of ``nvidia-smi -q`` and ``nvidia-smi topo -m``, or None without the command
    (or when it fails: no driver, no GPU)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    out = []
    for args in (["-q"], ["topo", "-m"]):
        try:
            done = subprocess.run([exe, *args], capture_output=True, text=True,
                                  timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0:
            return None
        out.append(done.stdout)
    return out[0], out[1]


def discover(host: str) -> HostGpus | None:
    """This host's GPUs from NVML, else from ``nvidia-smi``; None when it has none."""
    readings = read_nvml()
    if readings is not None:
        found = gpus_from_nvml(host, readings)
        return found if found.gpus else None
    smi = read_nvidia_smi()
    if smi is None:
        return None
    try:
        found = gpus_from_nvidia_smi(host, *smi)
    except ValueError:  # "No devices were found"
        return None
    return found if found.gpus else None


# ------------------------------------------------------------------------------- health
def read_health(nvml: Any, handle: Any) -> dict[str, float]:
    """One sample of a GPU's health (keys the straggler hint reads, see
    ``nbtrain.core.gpu_health``); values NVML cannot give are left out."""
    out: dict[str, float] = {}

    def put(key: str, call: Callable[[], Any], scale: float = 1.0) -> None:
        value = _try(call)
        if value is not None:
            out[key] = float(value) * scale

    sm = getattr(nvml, "NVML_CLOCK_SM", 1)
    put("sm_clock_mhz", lambda: nvml.nvmlDeviceGetClockInfo(handle, sm))
    put("sm_clock_max_mhz", lambda: nvml.nvmlDeviceGetMaxClockInfo(handle, sm))
    reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
    if reasons is not None:
        put("clocks_event_reasons", lambda: reasons(handle))
    put("temperature_c", lambda: nvml.nvmlDeviceGetTemperature(
        handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0)))
    put("power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle), 1e-3)  # milliwatts
    put("power_limit_w", lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle), 1e-3)
    put("ecc_uncorrected", lambda: nvml.nvmlDeviceGetTotalEccErrors(
        handle, getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
        getattr(nvml, "NVML_VOLATILE_ECC", 0)))
    put("gpu_util_pct", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    return out


class DeviceMonitor:
    """Samples one GPU's health every ``interval_s`` on a daemon thread and hands each sample
    to ``emit`` (the rank's event emitter, which is thread-safe).

    Critical XID errors are collected through an NVML event set polled without waiting at
    each sample; ``xid`` is the last one seen since the monitor started (absent if none).
    ``start()`` returns False (and nothing runs) without nvidia-ml-py or when the GPU cannot
    be found; a rank never fails because of its monitor.
    """

    def __init__(self, gpu: str, emit: Callable[[dict[str, float]], None],
                 interval_s: float = 10.0, nvml: Any | None = None) -> None:
        self.gpu = gpu  # its UUID ("GPU-...") or PCI bus id
        self.emit = emit
        self.interval_s = interval_s
        self._nvml = nvml
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._xid = 0

    def start(self) -> bool:
        nvml = self._nvml or _pynvml()
        if nvml is None or self.interval_s <= 0:
            return False
        try:
            nvml.nvmlInit()
        except Exception:
            return False
        try:
            handle = (nvml.nvmlDeviceGetHandleByUUID(self.gpu) if self.gpu.startswith("GPU-")
                      else nvml.nvmlDeviceGetHandleByPciBusId(self.gpu))
        except Exception:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
            return False
        self._nvml = nvml
        self._thread = threading.Thread(target=self._run, args=(nvml, handle),
                                        name="nbtrain-device-monitor", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def sample(self, nvml: Any, handle: Any, events: Any) -> dict[str, float]:
        if events is not None:
            while True:
                try:
                    data = nvml.nvmlEventSetWait_v2(events, 0)
                except Exception:  # NVMLError_Timeout: nothing new
                    break
                self._xid = int(data.eventData)
        readings = read_health(nvml, handle)
        if self._xid:
            readings["xid"] = float(self._xid)
        return readings

    def _run(self, nvml: Any, handle: Any) -> None:
        events = _try(nvml.nvmlEventSetCreate)
        xid_type = getattr(nvml, "nvmlEventTypeXidCriticalError", 0x8)
        if events is not None and _try(
                lambda: nvml.nvmlDeviceRegisterEvents(handle, xid_type, events)) is None:
            with contextlib.suppress(Exception):
                nvml.nvmlEventSetFree(events)
            events = None
        try:
            while True:
                with contextlib.suppress(Exception):
                    self.emit(self.sample(nvml, handle, events))
                if self._stop.wait(self.interval_s):
                    return
        finally:
            if events is not None:
                with contextlib.suppress(Exception):
                    nvml.nvmlEventSetFree(events)
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()


def monitor_device(device: Any, emit: Callable[[dict[str, float]], None],
                   interval_s: float) -> DeviceMonitor | None:
    """A started monitor of a rank's torch CUDA ``device`` (found in NVML by the UUID torch
    reports, whatever ``CUDA_VISIBLE_DEVICES`` says); None on CPU, with ``interval_s <= 0``,
    or without nvidia-ml-py."""
    if getattr(device, "type", "") != "cuda" or interval_s <= 0:
        return None
    import torch

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    monitor = DeviceMonitor(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}", emit,
                            interval_s)
    return monitor if monitor.start() else None
