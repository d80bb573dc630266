"""Training never talks to the network: no request reaches a recording server posing as
the Hub and as every proxy, and no Hub client or third-party HTTP library is even imported (torch itself
loads the standard library's http.client)."""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from support import PYTHON, REPO, script_env


class Recorder(BaseHTTPRequestHandler):
    seen: list[str] = []

    def _record(self) -> None:
        Recorder.seen.append(f"{self.command} {self.path}")
        self.send_response(500)
        self.end_headers()

    do_GET = do_POST = do_PUT = do_HEAD = do_CONNECT = _record

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def recording_server():
    Recorder.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


PROBE = """
import json, sys
from pipeline.config import load_config
from pipeline.train import train
config = load_config(sys.argv[1], {"data.dir": sys.argv[2], "checkpoint.dir": sys.argv[3], "training.max_steps": 6,
                                   "checkpoint.every": 2})
result = train(config, progress=False)
network = sorted(m for m in sys.modules if m.split(".")[0] in
                 {"huggingface_hub", "httpx", "httpx2", "requests", "urllib3", "aiohttp"})
print(json.dumps({"step": result.step, "network_modules": network}))
"""


def test_training_sends_no_request_and_imports_no_network_client(recording_server, data_dir, tmp_path):
    env = script_env(
        HF_ENDPOINT=recording_server,
        HTTP_PROXY=recording_server,
        HTTPS_PROXY=recording_server,
        ALL_PROXY=recording_server,
        http_proxy=recording_server,
        https_proxy=recording_server,
        HF_TOKEN="hf_" + "x" * 34,
    )
    result = subprocess.run(
        [PYTHON, "-c", PROBE, str(REPO / "config.yaml"), str(data_dir), str(tmp_path / "ckpt")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["step"] == 6
    assert report["network_modules"] == [], report["network_modules"]
    assert Recorder.seen == []


def test_the_recording_server_does_record(recording_server):
    """Guard for the test above: a request that is sent is seen."""
    import urllib.request

    with pytest.raises(Exception):
        urllib.request.urlopen(f"{recording_server}/api/models/x", timeout=60)
    assert Recorder.seen == ["GET /api/models/x"]
