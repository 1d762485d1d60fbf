"""Truth on the node: every process on the GPU attributed to a slice, every slice checked
against the driver.

A slice's usage file is the shim's fast path, written by the container's own processes;
the driver (NVML) knows which processes hold what.  The Observer turns one look at both
into a Snapshot: each process NVML lists on each device is attributed to a slice, marked
*unsliced*, or *unknown* (a pid this process cannot see); each slice's device has the
driver's figure (the sum of its processes' device memory) beside the shim's
(memory.current) and its cap.  The Agent (`vgpu-ctl agent`) looks every interval, reaps
dead slots, judges the snapshots over time (grace period, compute window) into
violations, logs each as one JSON line and, by policy, acts on the processes it is sure
of.  `status`, the metrics and the Kubernetes plugin read through the same Observer.

How a process is attributed (the first that applies; see docs/node-agent.md):
  usage-file     /proc/<pid>/maps holds the slice's usage file: the shim of that slice
                 runs in it (the kernel's word: a tenant cannot fake it for someone else);
  identity-file  the slice's identity file is mounted at /run/vgpu/.slice in the
                 process's mount namespace (stat through /proc/<pid>/root): the container
                 was given the slice, whatever the process loaded;
  pod            its cgroup path names the pod UID of the claim that made the slice;
  cgroup         it shares its cgroup with a process attributed above that lives in a
                 container (its own mount or pid namespace), of this slice only;
  pid-namespace  likewise its pid namespace (never the agent's own).
And a pid that is gone (or a zombie) here but whose memory a live process keeps on the
device is "held-slot": a slot of the slice still held (its lock taken: a forked child
inherited it) records that pid, or a shared slot (memory an importer keeps) records it as
its exporter -- only slots of the agent's own pid namespace.  Its memory counts in the
slice's driver figure; it is never acted on (there is no process to act on).
Two slices claiming a process is "ambiguous": reported with both, never acted on.  A pid
the agent cannot read is "unknown": reported, never acted on.  Nothing the usage file says
about its processes is taken as proof: its slots only help find them.

Where (Place): NVML lists processes per GPU, and on a GPU in MIG mode per MIG device, from
each MIG device's own handle (the GPU's own list is only an aggregate, and there is no
per-process utilization in MIG mode).  A software slice's quota device N is GPU N (CUDA's
ordinals follow NVML's in a container `env` made); a MIG slice's device 0 is its MIG
device, found by the UUID in its record (slices.MIG).  A process of a slice on a device
the slice does not hold is judged against a cap of 0 there.

The package, one module per concept:
  settings   what the agent tolerates and does (Settings, parse_actions, its constants)
  usage      a slice's usage file as the agent reads it (slots, charge rows)
  model      what a look is made of (Tracked, Attribution, Place, ProcRow, SliceDevice, Snapshot)
  watch      pidfds in epoll (and vgpu.inotify on usage files), a slice's kept files
  driver     where NVML lists which processes (GPUs, MIG devices)      } the Observer,
  attribute  whose slice a process on the GPU is                       } one class in
  evidence   the bracketed second look at a gap; a slot's lock holders } four modules
  observe    the Observer: one look at the node as a Snapshot
  judge      conditions that last become violations
  act        holding compute hogs to their share (SIGSTOP/SIGCONT)
  loop       the Agent: observe, reap, judge, act, every interval
  state      the agent's state file; what `status` shows of its view
"""
from .judge import Judge, Violation
from .loop import Agent
from .model import Attribution, Place, ProcRow, SliceDevice, Snapshot, record_place
from .observe import Observer
from .settings import KINDS, ORPHAN_S, Settings, parse_actions
from .state import agent_running, annotate, describe_violation, read_state, write_state

__all__ = ["Agent", "Attribution", "Judge", "KINDS", "ORPHAN_S", "Observer", "Place", "ProcRow", "Settings",
           "SliceDevice", "Snapshot", "Violation", "agent_running", "annotate", "describe_violation",
           "parse_actions", "read_state", "record_place", "write_state"]
