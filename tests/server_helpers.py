"""Real ``orca-serve`` processes for the server tests: started on free ports (``--port 0``),
stopped (SIGTERM, then SIGKILL) at the end of the session -- and by the kernel if pytest dies
(PR_SET_PDEATHSIG) -- so no server outlives the tests."""
from __future__ import annotations

import ctypes
import datetime
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

START_TIMEOUT = 120.0  # importing torch and building the model on a busy 2-core machine
# The built-in model with a small KV pool (the tests' requests are short).
BASE_ARGS = ["--model", "orca-tiny", "--kv-cache-tokens", "4096", "--log-level", "warning"]
# orca-tiny has no chat template; the tests chat with it through this one (--chat-template):
# one "role: content" line per message, then "assistant:".
PLAIN_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: "
                       "{{ message['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class ServerProcess:
    """``python -m orca_ext.server --port 0 ...args``; ``base_url``, ``grpc_target`` once up."""

    def __init__(self, *args: str, scheme: str = "http", verify: str | bool = True,
                 api_key: str | None = None) -> None:
        self.args = [*BASE_ARGS, *args]
        self.verify = verify
        self.api_key = api_key
        self.base_url: str | None = None
        self.grpc_target: str | None = None
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._wants_grpc = "--grpc-port" in args

    def start(self) -> ServerProcess:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="orca-serve-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orca_ext.server", "--port", "0", *self.args],
            stdout=subprocess.PIPE, stderr=self.log, text=True, preexec_fn=_die_with_parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while not self._ready.wait(0.2):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"orca-serve did not start:\n{self.output()}")
            with self.client() as client:
                while client.get("/health").status_code != 200:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"orca-serve is not healthy:\n{self.output()}")
                    time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:  # keeps draining, so the pipe never fills
            self.lines.append(line)
            if m := re.search(r"HTTP listening on (\S+)", line):
                self.base_url = m.group(1)
            if m := re.search(r"gRPC listening on (\S+)", line):
                self.grpc_target = m.group(1)
            if self.base_url and (self.grpc_target or not self._wants_grpc):
                self._ready.set()

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return "".join(self.lines) + self.log.read()[-5000:]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        kwargs.setdefault("timeout", 60.0)
        return httpx.Client(base_url=self.base_url, verify=self.verify, **kwargs)

    def async_client(self, **kwargs) -> httpx.AsyncClient:
        kwargs.setdefault("timeout", 60.0)
        return httpx.AsyncClient(base_url=self.base_url, verify=self.verify, **kwargs)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {"name{labels}": value}."""
        with self.client() as client:
            text = client.get("/metrics").text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Wait until no request is left and every KV block is free; return the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["orca_kv_cache_used_blocks"] == 0 and m["orca_num_unfinished_requests"] == 0
                    and m["orca_num_requests_waiting"] == 0
                    and m["orca_num_requests_running"] == 0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not drain: {m}")
            time.sleep(0.1)


_SHARED: dict[str, ServerProcess] = {}


@pytest.fixture(scope="session")
def server() -> ServerProcess:
    """The shared plain server: HTTP + gRPC, no key, body limit 1 MiB, the plain chat
    template."""
    srv = _SHARED.get("main")
    if srv is None or not srv.alive():
        srv = _SHARED["main"] = ServerProcess("--grpc-port", "0", "--max-body-bytes", "1MiB",
                                              "--max-batch-size", "32", "--chat-template",
                                              PLAIN_CHAT_TEMPLATE).start()
    yield srv
    srv.stop()


def make_self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key (PEM files in ``folder``)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path
