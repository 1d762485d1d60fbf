"""The driver layer for containers: the node agent puts each slice's memory cap on the cgroup
its container's processes live in (vgpu.driverlimits; `vgpu-ctl run` does it for its own).

Which cgroup: the one the slice's processes the agent attributes with certainty share,
when they live in a container (a mount or pid namespace other than the agent's: the
host's own cgroups, a shell's session, are never limited).  The decisions, as
docs/node-agent.md says them:
- one slice in one cgroup: that cgroup gets hard = memory.max and soft = the request on
  each device the slice holds;
- one slice over several cgroups: where they are the containers of its pod (below the
  pod's cgroup, which names the pod's UID, as the kubelet's cgroup drivers do), the pod's
  cgroup gets the limit: a pod's claim covers its containers; else none does (each would
  get the whole cap: twice the cap together), the shim alone holds it ("its processes span
  several cgroups");
- several slices in one cgroup: none of them does (one limit cannot be two caps), the
  shim alone ("its cgroup is shared with slice b").
A limit is set as soon as the cgroup is first seen, follows resizes (the quota's
generation), and is cleared when the slice goes or its processes leave the cgroup.  Where
the driver cannot (no such API, no permission, MIG) it fails open to the shim, said once
per slice.  Limits stay when the agent stops: the cap holds without it, and a container's
end (its cgroup removed) clears them.
"""
import os

from .. import driverlimits, procfs


class CgroupLimits:
    def __init__(self, observer, log):
        self.observer, self.log = observer, log
        self.applied = {}        # slice -> (cgroup path, quota generation, {device: (soft, hard)})
        self.refused = {}        # slice -> why the driver does not hold it (said once)

    def _cgroups(self, snap):
        """{slice: {cgroup path below the cgroup v2 root}} of the slices' processes in containers."""
        obs, out = self.observer, {}
        for p in snap.processes:
            a = p.attribution
            t = obs.tracked.get(p.host_pid)
            if a.state != "sliced" or not a.certain or t is None or not t.visible or not t.cgroup or \
                    t.cgroup == "/" or (t.mnt_ns == obs.my_mnt_ns and t.pid_ns == obs.my_pid_ns):
                continue
            out.setdefault(a.slice, set()).add(t.cgroup)
        return out

    def wanted(self, snap) -> tuple:
        """({slice: cgroup}, {slice: why not}) for this look."""
        cgroups = self._cgroups(snap)
        sharing = {}
        for name, groups in cgroups.items():
            for g in groups:
                sharing.setdefault(g, set()).add(name)
        want, why = {}, {}
        pods = self._pod_uids()
        for name, groups in cgroups.items():
            if len(groups) > 1:
                g = _pod_cgroup(groups, pods.get(name, ()))
                if g is None:
                    why[name] = "its processes span several cgroups"
                    continue
            else:
                (g,) = groups
            others = sorted({n for h, names in sharing.items() if h == g or h.startswith(g + "/")
                             for n in names} - {name})
            if others:
                why[name] = f"its cgroup is shared with slice {', '.join(others)}"
                continue
            want[name] = g
        return want, why

    def _pod_uids(self) -> dict:
        """{slice: {pod UID}}: from its pod labels, and from the Kubernetes claims the agent knows."""
        out = {}
        for name, f in self.observer.files.items():
            if f.pod_uid:
                out.setdefault(name, set()).add(f.pod_uid)
        for name, uids in (self.observer.pod_uids() or {}).items():
            out.setdefault(name, set()).update(uids or ())
        return out

    def update(self, snap):
        root = driverlimits.cgroup2_root()
        if root is None or not snap.nvml_ok:
            return
        want, why = self.wanted(snap)
        for name in [n for n in self.applied if n not in want]:
            self._clear(name)
        for name in [n for n in self.refused if n not in why and n not in want]:
            del self.refused[name]   # no process in a container now: nothing to say of it
        for name, reason in why.items():
            self._refuse(name, reason)
        views = self.observer.reader.views
        for name, group in want.items():
            path = str(root) + group
            view = views.get(name)
            if view is None:
                continue         # gone, or unreadable: the next look sees to it
            view.refresh_quota()   # (a seqlock read of its mapping: after a resize, the new quota)
            quota = view.quota
            devices = driverlimits.for_quota(quota)
            old = self.applied.get(name)
            if old is not None and old[:2] == (path, quota.generation):
                continue
            if old is not None and old[0] != path:
                self._clear(name)
            try:
                driverlimits.apply(path, devices, view.mig is not None)
                driverlimits.clear(path, [d for d in (old[2] if old else {}) if d not in devices])
            except driverlimits.Unavailable as e:
                self._refuse(name, str(e))
                continue
            self.applied[name] = (path, quota.generation, devices)
            self.refused.pop(name, None)
            self.log("driver-limit", slice=name, cgroup=path,
                     devices={str(d): {"soft": s, "hard": h} for d, (s, h) in sorted(devices.items())},
                     result="resized" if old is not None and old[0] == path else "set")

    def _refuse(self, name, reason):
        if name in self.applied:
            self._clear(name)
        if self.refused.get(name) != reason:
            self.refused[name] = reason
            self.log("driver-limit", slice=name, result="shim only", why=reason)

    def _clear(self, name):
        path, _, devices = self.applied.pop(name)
        if os.path.isdir(path):
            driverlimits.clear(path, list(devices))
        self.log("driver-limit", slice=name, cgroup=path, result="cleared")

    def state(self) -> dict:
        """For `status`: {slice: {"cgroup": path}} held by the driver, {slice: {"why": ...}} not."""
        return {**{n: {"cgroup": p} for n, (p, _, _) in self.applied.items()},
                **{n: {"why": w} for n, w in self.refused.items() if n not in self.applied}}


def _pod_cgroup(groups, uids):
    """The cgroup of the pod whose containers these cgroups are: their common parent, when
    its name carries one of the slice's pod UIDs (the systemd driver writes '_' for '-');
    else None."""
    parts = [g.strip("/").split("/") for g in groups]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    if not common:
        return None
    leaf = common[-1]
    if any(procfs.cgroup_names_pod(leaf, uid) for uid in uids):
        return "/" + "/".join(common)
    return None
