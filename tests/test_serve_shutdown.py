"""Stopping the server (issue 31): the first SIGINT/SIGTERM drains (no new connections; requests in flight
run on for up to --drain-timeout, then fail with 503's words), a second SIGINT fails them at once; either
way the process exits 0 with no traceback (before: exit 134 and CancelledError tracebacks).

The process is tests/serve_child.py: the real app, runner and `run_server` over a scripted engine that
never finishes a request on its own (so only the shutdown can end it). Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

for _name in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_name, reason=f"{_name} is not installed: the server tests need the serving extras")
import httpx  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_leftover_process():
    yield
    while _started:  # a failed test must not leave its server running
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(drain: float, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.serve_child", str(port), str(drain)], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
    _started.append(proc)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.2)


def _stream_in_background(base: str) -> tuple[threading.Thread, dict]:
    """A streaming request that only the shutdown can end; returns (thread, result dict)."""
    out: dict = {}
    opened = threading.Event()

    def run() -> None:
        body = {"model": "scripted", "prompt": "x", "max_tokens": 50, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", base + "/v1/completions", json=body) as r:
            out["status"] = r.status_code
            opened.set()
            out["text"] = "".join(r.iter_text())
            out["ended_at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert opened.wait(30)
    return t, out


def _wait_exit(proc: subprocess.Popen, log: Path, timeout: float = 30) -> str:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        pytest.fail(f"server still running {timeout} s after the signal:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    return text


def test_first_signal_drains_until_the_timeout(tmp_path):
    log = tmp_path / "server.log"
    proc, base = _start(1.5, log)
    t, out = _stream_in_background(base)
    time.sleep(0.3)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # draining: no new connections
        httpx.get(base + "/health", timeout=2)
    t.join(30)
    assert out["status"] == 200 and "server shutting down" in out["text"] and "[DONE]" in out["text"]
    assert 1.3 <= out["ended_at"] - sent <= 10, out["ended_at"] - sent  # ran on until the drain timeout
    text = _wait_exit(proc, log)
    assert "draining 1 request(s) in flight for up to 2 s" in text and "drain timeout: failing 1" in text


def test_second_ctrl_c_fails_requests_now_and_exits_cleanly(tmp_path):
    log = tmp_path / "server.log"
    proc, base = _start(120, log)
    t, out = _stream_in_background(base)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert t.is_alive()  # draining: the request runs on
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    t.join(30)
    assert "server shutting down" in out["text"] and out["ended_at"] - sent < 10
    text = _wait_exit(proc, log)
    assert "SIGINT again: failing 1 request(s) in flight now" in text
