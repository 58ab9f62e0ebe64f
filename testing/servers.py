"""`radixlm <command>` (serve, router) in a subprocess on a free loopback port, its URL read back from its
log line: the one launcher the server tests, benchmarks/bench_router.py and benchmarks/fault_probe.py share."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading


class ServerProcess:
    def __init__(self, *flags: str, command: str = "serve", env: dict[str, str] | None = None,
                 start_timeout: float = 180) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "radixlm.server.cli", command, "--port", "0", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.log: list[str] = []
        self.url: str | None = None
        found = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line)
                match = re.search(r"listening on (https?://\S+?) ", line)
                if match:
                    self.url = match.group(1)
                    found.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not found.wait(start_timeout):
            self.kill()
            raise RuntimeError(f"radixlm {command} did not start:\n" + "".join(self.log[-40:]))

    def signal(self, sig: int = signal.SIGTERM) -> int:
        """Sends sig and returns the exit status."""
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=60)
        self.reader.join(timeout=10)
        return code

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
