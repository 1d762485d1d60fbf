"""A real Prometheus for the tests: the server and promtool of Debian's `prometheus` package.

`tools()` finds both on PATH; where they are missing and this runs as root with apt-get, it
installs the package first (once per process; two pytest workers wait on dpkg's lock), and
where that cannot be done the calling test skips.  `Prometheus` runs a server on loopback
with a config it is given, in a directory of the test's, and stops it when the `with` block
ends: no process outlives a test.
"""
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

PACKAGE = "prometheus"          # Debian's: /usr/bin/prometheus and /usr/bin/promtool
_install_tried = []


def _install():
    if _install_tried or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    _install_tried.append(True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300", PACKAGE]
    for step in ([install], [["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=300"], install]):
        if all(subprocess.run(cmd, env=env, capture_output=True, timeout=900).returncode == 0 for cmd in step):
            return


def tools():
    """(prometheus, promtool): their paths, or the test skips."""
    if not (shutil.which("prometheus") and shutil.which("promtool")):
        _install()
    found = shutil.which("prometheus"), shutil.which("promtool")
    if not all(found):
        pytest.skip(f"no prometheus/promtool here, and Debian's `{PACKAGE}` package could not be installed "
                    "(apt-get needs root and a package index)")
    return found


def promtool(*args, cwd=None, timeout=120):
    return subprocess.run([tools()[1], *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """`prometheus` with `config` (a dict: prometheus.yml) in `workdir`, on a free loopback port."""

    def __init__(self, workdir: Path, config: dict):
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.dir / "prometheus.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [tools()[0], f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            self._until_ready()
        except BaseException:
            self.stop()
            raise

    def _until_ready(self, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"prometheus did not get ready:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def api(self, path, **params):
        """GET /api/v1/PATH; its `data`, or AssertionError with Prometheus' error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr):
        """An instant query now: the list of {"metric": labels, "value": [t, "v"]}."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return data["result"]

    def query_range(self, expr, start, end, step):
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def wait_for(self, expr, done=bool, timeout=60, every=0.25):
        """Poll `expr` until done(result) holds; the result."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if done(result):
                return result
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{expr}: still {result} after {timeout}s")
            time.sleep(every)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
