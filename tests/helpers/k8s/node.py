"""A simulated GPU node for the DRA driver: `vgpu-ctl k8s-plugin` as a real process, the
shim installed, the kubelet stand-in, claims in the fake API server.  Shared by
tests/k8s/test_k8s_plugin.py and bench/test_k8s_plugin_bench.py.
"""
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

from tests.helpers.k8s.fake_api import allocated_claim
from tests.helpers.k8s.kubelet import Kubelet

CTL = str(Path(sys.executable).parent / "vgpu-ctl")
DRIVER, NODE, NS = "vgpu.dev", "node-a", "team-a"


class Agent:
    """One `vgpu-ctl k8s-plugin` process; its log lines are JSON."""

    def __init__(self, node, *extra, env=None):
        self.node = node
        self.log_path = node.tmp / f"agent-{time.monotonic_ns()}.log"
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen([CTL, "k8s-plugin", *node.args, *extra], env={**node.env, **(env or {})},
                                     stdout=self.log_file, stderr=subprocess.STDOUT, text=True)

    def events(self):
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def wait_for(self, predicate, what, timeout=30, count=1):
        """The last log line `predicate` holds for, once it holds for `count` of them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events() if predicate(e)]
            if len(found) >= count:
                return found[-1]
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode} waiting for {what}:\n"
                                     f"{self.log_path.read_text()}")
            time.sleep(0.05)
        raise AssertionError(f"no {what} in {timeout} s:\n{self.log_path.read_text()}")

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        return self.proc.returncode


class Node:
    """A simulated GPU node: simgpu with two A10s, the shim installed, a fake API server."""

    def __init__(self, tmp, api, env):
        """env: a simgpu environment with two A10s."""
        self.tmp, self.api, self.env = tmp, api, env
        # a unix socket's path has at most 107 bytes, and pytest's temporary directories
        # under xdist (.../pytest-NN/popen-gwN/<test name>/) come close: the plugin's and
        # the registry's sockets are reached through a short link in /tmp
        (tmp / "sockets").mkdir()
        self.link = Path(tempfile.gettempdir()) / f"vgpu-k8s-{secrets.token_hex(4)}"
        self.link.symlink_to(tmp / "sockets")
        self._unlink = weakref.finalize(self, self.link.unlink, missing_ok=True)   # (close() or not)
        self.plugin_dir, self.registry_dir = self.link / "plugins" / DRIVER, self.link / "plugins_registry"
        self.cdi_dir, self.slice_dir, self.shim_dir = tmp / "cdi", tmp / "run-vgpu", tmp / "opt-vgpu"
        self.registration_socket = self.registry_dir / f"{DRIVER}-reg.sock"
        self.checkpoint = self.plugin_dir / "checkpoint.json"
        subprocess.run([CTL, "install-shim", str(self.shim_dir)], env=self.env, check=True, capture_output=True)
        api.add_node(NODE)
        api.write_kubeconfig(tmp / "kubeconfig")
        self.args = ["--node-name", NODE, "--plugin-dir", str(self.plugin_dir), "--registry-dir",
                     str(self.registry_dir), "--cdi-dir", str(self.cdi_dir), "--dir", str(self.slice_dir),
                     "--shim-dir", str(self.shim_dir), "--gpu-cdi-device", "", "--kubeconfig",
                     str(tmp / "kubeconfig"), "--rescan", "300ms"]
        self.agents, self.kubelets = [], []

    def close(self):
        """Stop what the node started: its kubelet stand-ins and its agents (SIGKILL)."""
        for k in self.kubelets:
            k.close()
        for a in self.agents:
            a.stop(signal.SIGKILL)
        self._unlink()

    def start(self, *extra, env=None):
        agent = Agent(self, *extra, env=env)
        self.agents.append(agent)
        agent.wait_for(lambda e: e["event"] == "serving", "serving line")
        return agent

    def kubelet(self, wipe=True, **kw):
        """A kubelet stand-in on this node, started (wipe: deleting the node's slices first,
        as a starting kubelet does) and with the plugin registered."""
        from kubernetes import client, config
        configuration = client.Configuration()
        config.load_kube_config(config_file=str(self.tmp / "kubeconfig"), client_configuration=configuration)
        k = Kubelet(str(self.registration_socket), api=client.ApiClient(configuration), node=NODE,
                    cdi_dirs=[str(self.cdi_dir)], **kw)
        self.kubelets.append(k)
        if wipe:
            k.start()
        else:
            k.register()
        return k

    def published(self, timeout=10):
        """This node's ResourceSlices of the driver, once there are some (AssertionError if not in time)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in self.api.slices() if s["spec"].get("nodeName") == NODE]
            if found:
                return found
            time.sleep(0.02)
        raise AssertionError(f"no ResourceSlice for {NODE} in {timeout} s")

    def claim(self, name, uid=None, results=({"device": "gpu-0", "memory": "4Gi", "sm": "50"},), pool=NODE):
        """An allocated claim in the API server; returns (namespace, uid, name) as the kubelet sends it."""
        rs = [{"request": "gpu", "share_id": f"{name}-share-{i}", **r} for i, r in enumerate(results)]   # r may set it
        obj = allocated_claim(NS, name, DRIVER, pool, rs)
        if uid:
            obj["metadata"]["uid"] = uid
        stored = self.api.put_claim(obj)
        return NS, stored["metadata"]["uid"], name

    def ctl(self, *args):
        out = subprocess.run([CTL, *args, "--dir", str(self.slice_dir)], env=self.env, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def status(self):
        if not os.path.isdir(self.slice_dir):     # no slice was ever made here
            return {}
        return {c["name"]: c for c in json.loads(self.ctl("status", "--json"))["slices"]}
