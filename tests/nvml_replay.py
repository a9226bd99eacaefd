"""A stand-in for nvidia-ml-py's ``pynvml`` that answers from recorded readings.

No GPU or NVIDIA driver exists on the development and CI machines, so the NVML reader
(``nbtrain.runtime.nvml``) is checked against the recordings in ``tests/data/gpu``: the calls
it makes, with nvidia-ml-py's names, signatures and error behaviour (``NVMLError`` with NVML's
codes: Not Supported for NVLink on PCIe-only GPUs and for fabric info on GPUs without a
fabric, Invalid Argument past a GPU's last link, Timeout from an empty event set).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10
NVML_NVLINK_MAX_LINKS = 36
NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
nvmlEventTypeXidCriticalError = 0x8


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


@dataclass
class _Pci:
    busId: bytes


class c_nvmlGpuFabricInfoV_t:
    def __init__(self) -> None:
        self.clusterUuid = (0,) * 16
        self.status = 0
        self.cliqueId = 0
        self.state = 0


@dataclass
class _Event:
    eventData: int


class RecordedNvml:
    """``pynvml`` for one recorded host (``{"gpus": [...], "driver": ...}``), plus health
    values per GPU index (``health``) and critical XIDs waiting in the event set (``xids``)."""

    NVMLError = NVMLError
    c_nvmlGpuFabricInfoV_t = c_nvmlGpuFabricInfoV_t

    def __init__(self, host: dict[str, Any], health: dict[int, dict[str, float]] | None = None,
                 xids: list[int] | None = None) -> None:
        self.host = host
        self.health = health or {}
        self.xids = list(xids or [])
        self.inits = 0
        for name in ("NVML_NVLINK_MAX_LINKS", "NVML_CLOCK_SM", "NVML_TEMPERATURE_GPU",
                     "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC",
                     "nvmlEventTypeXidCriticalError"):
            setattr(self, name, globals()[name])

    def _gpu(self, handle: int) -> dict[str, Any]:
        return dict(self.host["gpus"][handle])

    # -- session and listing (nvidia-ml-py's names)
    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.inits -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self.host.get("driver", ""))

    def nvmlDeviceGetCount(self) -> int:
        return len(self.host["gpus"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> int:
        for i, g in enumerate(self.host["gpus"]):
            if g["pci_bus_id"].lower() == bus_id.lower():
                return i
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetHandleByUUID(self, gpu: str) -> int:
        for i, g in enumerate(self.host["gpus"]):
            if g["uuid"] == gpu:
                return i
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return str(self._gpu(handle)["uuid"])

    def nvmlDeviceGetName(self, handle: int) -> str:
        return str(self._gpu(handle)["name"])

    def nvmlDeviceGetPciInfo(self, handle: int) -> _Pci:
        return _Pci(self._gpu(handle)["pci_bus_id"].encode())

    # -- NVLink
    def _link(self, handle: int, link: int) -> dict[str, Any]:
        links = self._gpu(handle)["nvlinks"]
        if not links:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if link >= len(links):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return dict(links[link])

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:
        return int(self._link(handle, link)["state"])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: int, link: int) -> int:
        return int(self._link(handle, link)["remote_device_type"])

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: int, link: int) -> _Pci:
        return _Pci(str(self._link(handle, link)["remote_pci_bus_id"]).encode())

    def nvmlDeviceGetGpuFabricInfoV(self, handle: int,
                                    info: c_nvmlGpuFabricInfoV_t) -> int:
        fabric = self._gpu(handle)["fabric"]
        if fabric is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        info.clusterUuid = tuple(uuid.UUID(fabric["cluster_uuid"]).bytes)
        info.cliqueId = fabric["clique_id"]
        info.state = fabric["state"]
        info.status = fabric["status"]
        return 0

    # -- health
    def _health(self, handle: int, key: str) -> float:
        value = self.health.get(handle, {}).get(key)
        if value is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetClockInfo(self, handle: int, kind: int) -> int:
        return int(self._health(handle, "sm_clock_mhz"))

    def nvmlDeviceGetMaxClockInfo(self, handle: int, kind: int) -> int:
        return int(self._health(handle, "sm_clock_max_mhz"))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        return int(self._health(handle, "clocks_event_reasons"))

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        return int(self._health(handle, "temperature_c"))

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return int(self._health(handle, "power_w") * 1000)  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        return int(self._health(handle, "power_limit_w") * 1000)

    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int,
                                    counter: int) -> int:
        return int(self._health(handle, "ecc_uncorrected"))

    # -- events
    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: int, kinds: int,
                                 events: str) -> None:
        return None

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> _Event:
        if not self.xids:
            raise NVMLError(NVML_ERROR_TIMEOUT)
        return _Event(self.xids.pop(0))

    def nvmlEventSetFree(self, events: str) -> None:
        return None
