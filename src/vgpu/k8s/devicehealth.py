"""The DRA driver's view of its GPUs' health (vgpu.health.Watcher): which GPUs it publishes
and prepares claims on, what the kubelet's health stream says of each device
(plugin.HealthService), and the log lines."""
from .. import health
from . import resourceslice


class DeviceHealth:
    def __init__(self, node, gpus, emit, on_unhealthy):
        """gpus: the agent's list of this node's GPUs (read, never changed here);
        on_unhealthy(): a GPU just turned unhealthy (publish again)."""
        self.node, self.gpus, self.emit, self.on_unhealthy = node, gpus, emit, on_unhealthy
        self.sick = {}           # GPU index -> why: left out of the slice and of new claims
        self.driver = None       # set once made: its prepared claims' devices are reported too
        from . import plugin     # (it needs grpc, of the k8s extra: the agent has checked for it)
        self.feed = plugin.DeviceHealthFeed(self.devices)
        self.watcher = health.Watcher(self._event)

    def healthy(self) -> list:
        return [g for g in self.gpus if g.index not in self.sick]

    def devices(self) -> list:
        """(pool, device, healthy, why) of every GPU and every device of a prepared claim: a
        device's health is its GPU's; a GPU this node no longer has is unknown (None)."""
        known = {g.index for g in self.gpus}
        named = {(self.node, g.name) for g in self.gpus}
        if self.driver is not None:
            with self.driver.lock:
                named |= {(d.get("pool_name"), d.get("device_name")) for e in self.driver.claims.values()
                          for d in e.get("devices", ())}
        out = []
        for pool, name in sorted(named, key=str):
            index = (resourceslice.parse_device(str(name)) or (None, None))[1]
            if index in self.sick:
                out.append((pool, name, False, self.sick[index]))
            else:
                out.append((pool, name, True if index in known else None, None))
        return out

    def _event(self, kind, gpu, xid):
        if kind == "xid":
            what, action, _ = health.meaning(xid)
            self.emit({"event": "xid", "device": gpu.index, "xid": xid, "meaning": what, "nvidia_action": action})
        elif kind == "unhealthy":
            self.sick[gpu.index] = gpu.reason
            self.emit({"event": "gpu_unhealthy", "device": gpu.index, "reason": gpu.reason,
                       "result": "left out of the ResourceSlice and of new claims"})
            self.on_unhealthy()
            self.feed.changed()
        else:
            self.emit({"event": "gpu_health", "watching": False, "why": self.watcher.unavailable})

    def start(self):
        self.watcher.start()

    def stop(self):
        self.watcher.stop()
