"""A live ExactScore server for the tests: the debug binary `cargo test` builds, on the bundled
tiny model (W4A16) with its dense bf16 original as the reference model, on a free loopback port.

EXACTSCORE_SERVER_BIN names the binary (default: target/debug/exactscore-server of this
repository)."""

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
API_KEY = "pytest-key"


class Server:
    def __init__(self, url: str) -> None:
        self.url = url

    def request(
        self, route: str, body: Optional[Dict[str, Any]] = None, api_key: str = API_KEY
    ) -> Tuple[int, Any]:
        """The server's own answer to a request: (status, parsed JSON body)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + route,
            data=data,
            headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    binary = os.environ.get(
        "EXACTSCORE_SERVER_BIN",
        str(Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "debug/exactscore-server"),
    )
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [
            binary,
            "--host", "127.0.0.1",
            "--port", "0",
            "--model", str(REPO / "tests/fixtures/llama-w4a16-g128"),
            "--reference-model", str(REPO / "tests/fixtures/llama-dense-bf16"),
        ],
        env={**os.environ, "EXACTSCORE_API_KEY": API_KEY, "RUST_LOG": "warn,exactscore_server=info"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        addr = None
        while addr is None:
            m = re.search(r"ready addr=(127\.0\.0\.1:\d+)", log_path.read_text())
            if m:
                addr = m.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{log_path.read_text()}")
            else:
                time.sleep(0.1)
        yield Server(f"http://{addr}")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
