"""Where a client keeps the tokens of the jobs it submitted (one JSON file per user).

A job's token lets its owner steer it. Kept on disk (mode 0600, keyed by scheduler address
and job id), a restarted kernel of the same user can stop or preempt the jobs it submitted
before; another user, or a client with ``token_file=""``, cannot.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading

__all__ = ["TokenStore"]


class TokenStore:
    def __init__(self, path: str) -> None:
        self.path = os.path.expanduser(path) if path else ""
        self._memory: dict[str, str] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(address: str, job_id: str) -> str:
        return f"{address}/{job_id}"

    def put(self, address: str, job_id: str, token: str) -> None:
        key = self._key(address, job_id)
        with self._lock:
            self._memory[key] = token
            if not self.path:
                return
            data = self._read()
            data[key] = token
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
            tmp = f"{self.path}.tmp-{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, self.path)

    def get(self, address: str, job_id: str) -> str:
        key = self._key(address, job_id)
        with self._lock:
            if key in self._memory:
                return self._memory[key]
            return str(self._read().get(key, "")) if self.path else ""

    def _read(self) -> dict[str, str]:
        with contextlib.suppress(OSError, ValueError), open(self.path) as f:
            data = json.load(f)
            if isinstance(data, dict):
                return {str(k): str(v) for k, v in data.items()}
        return {}
