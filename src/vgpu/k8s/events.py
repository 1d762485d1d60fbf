"""Kubernetes Events from the node agent: a violation (and what was done about it) on the
pod whose claim made the slice, so `kubectl describe pod` and `kubectl get events` show it.

The pod comes from the slice's labels (vgpu.podlabels: namespace and pod, written by the DRA
driver from the claim's reservedFor); a slice made by hand, or one whose claim serves no
single pod, gets no Event (the agent's log line and metrics still say it).  Events are
best effort: sent from a thread of their own so the agent's loop never waits on the API
server, dropped (and counted) when it is down or the queue is full, never retried.

RBAC: `create` on core `events` (deploy/dra/rbac.yaml).
"""
import datetime
import queue
import threading

from .. import podlabels
from ..agent.state import describe_violation

REASONS = {"over-cap": "VgpuOverCap", "gap": "VgpuUncountedMemory", "unsliced": "VgpuUnsliced",
           "compute": "VgpuComputeBypass"}
COMPONENT = "vgpu-agent"


def event(namespace, pod, reason, message, node, kind="Warning", pod_uid=None) -> dict:
    """A core/v1 Event about pod `namespace/pod` (as the API takes it).  `kubectl describe
    pod` lists only Events naming the pod's uid (its field selector has involvedObject.uid),
    so it is set whenever known."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    involved = {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": pod}
    if pod_uid:
        involved["uid"] = pod_uid
    return {"apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{pod}.vgpu-", "namespace": namespace},
            "involvedObject": involved,
            "reason": reason, "message": message[:1024], "type": kind,
            "source": {"component": COMPONENT, "host": node}, "reportingComponent": f"vgpu.dev/{COMPONENT}",
            "reportingInstance": node, "firstTimestamp": now, "lastTimestamp": now, "count": 1}


class EventSink:
    """agent.Agent's on_violation / on_action: queues an Event per violation and action on a
    DRA slice's pod; `post(namespace, body)` sends one (the kubernetes client by default)."""

    def __init__(self, directory, node, post=None, api=None, log=lambda event: None, size=256):
        self.directory, self.node, self.log = directory, node, log
        if post is None:
            from kubernetes import client
            core = client.CoreV1Api(api)
            post = lambda namespace, body: core.create_namespaced_event(namespace, body, _request_timeout=10)  # noqa: E731
        self.post = post
        self.queue = queue.Queue(size)
        self.sent = self.dropped = 0
        threading.Thread(target=self._run, name="vgpu-events", daemon=True).start()

    def _pod(self, name):
        """(namespace, pod, pod uid) the slice serves; pod None when it serves none."""
        labels = podlabels.read(self.directory, name) if name else {}
        return (labels.get("namespace"), labels.get("pod"), labels.get("pod_uid")) if labels.get("pod") else \
            (None, None, None)

    def violation(self, v, record):
        namespace, pod, uid = self._pod(v.slice)
        if pod:
            self._put(event(namespace, pod, REASONS.get(v.kind, "VgpuViolation"),
                            f"slice {v.slice} device {v.device}: {describe_violation(record)}", self.node,
                            pod_uid=uid))

    def action(self, name, kind, action, pid, result):
        namespace, pod, uid = self._pod(name)
        if pod:
            self._put(event(namespace, pod, "VgpuAction", f"{action} pid {pid} ({kind}): {result}", self.node,
                            pod_uid=uid))

    def _put(self, body):
        try:
            self.queue.put_nowait(body)
        except queue.Full:
            self.dropped += 1

    def _run(self):
        while True:
            body = self.queue.get()
            try:
                self.post(body["metadata"]["namespace"], body)
                self.sent += 1
            except Exception as e:   # the API server down, RBAC missing: the log line says it, once each
                self.dropped += 1
                self.log({"event": "k8s_event_failed", "error": f"{type(e).__name__}: {e}"[:300]})
            finally:
                self.queue.task_done()
