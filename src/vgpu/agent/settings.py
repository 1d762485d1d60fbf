"""The agent's settings: what it tolerates, how long, and what it does about each kind."""
from dataclasses import dataclass, field


from ..quantities import UNLIMITED

MiB = 1 << 20
KINDS = ("over-cap", "gap", "forged", "unsliced", "compute")
ACTIONS = {"over-cap": ("report", "kill"), "gap": ("report", "kill"), "forged": ("report", "kill"),
           "unsliced": ("report", "kill"),
           "compute": ("report", "kill", "stop")}
CERTAIN = ("usage-file", "identity-file", "pod", "cgroup", "pid-namespace")
STATE_FILE = ".agent.json"      # in the node directory (no slice name starts with '.')
IDENTITY_PATH = "/run/vgpu/.slice"
RECHECK_S = 10.0                # a process found in no slice is looked at again this often
ORPHAN_S = 2.0                  # temporary slices' owners are checked this often
SLACK_S = 0.005
SWEEP_LOOKS = 30                # and every slice once in 30 looks (a net under the inotify events)
RECENT_NS = 100_000_000         # a directory changed this recently is looked at again (coarse timestamps)
MIG_RESCAN_S = 30.0             # a MIG-mode GPU's MIG devices are listed again this often
RECHECK_AFTER = (0.005, 0.03, 0.1, 0.3)   # s after an open or close of a usage file: its slice looked at again
MIG_FORCED_S = 2.0              # ... and out of turn (a new instance, one gone) at most this often
# a slot charging this much on one device was written by hand: no device has 2^48 bytes (256
# TiB), and the shim never charges what a device cannot hold ("negative" charges are 2^64 - x)
FORGED_CHARGE = 1 << 48
CONFIRM_TRIES = 3               # bracketed looks at a gap before it is left unjudged (charges moving)


# === settings ===

@dataclass
class Settings:
    tolerance: int = 64 * MiB       # memory the driver may hold beyond the shim's figure / the cap
    tolerance_ratio: float = 0.02   # ... or this share of the cap, whichever is larger
    process_overhead: int = 0       # per process, on top (a context's own memory the shim does not charge)
    # a process of the slice that has charged nothing on a device since the agent first saw
    # it holds its context's memory there, which the shim charges with its first
    # allocation: up to this much of it is not a gap (a framework loading a model between
    # creating its context and allocating)
    context_allowance: int = 512 * MiB
    grace: float = 0.5              # a memory or unsliced condition must last this long
    window: float = 10.0            # a compute condition must hold on average over this long
    compute_margin: int = 1000      # NVML's share may pass sm.max by this much (1/100 percent: 10 points)
    require_slices: bool = False    # a GPU process in no slice is a violation
    actions: dict = field(default_factory=dict)   # kind -> report | kill | stop

    def action(self, kind):
        return self.actions.get(kind, "report")

    def tolerance_for(self, cap, processes=0) -> int:
        base = self.tolerance if cap in (None, UNLIMITED) else max(self.tolerance, int(cap * self.tolerance_ratio))
        return base + processes * self.process_overhead

    def to_json(self):
        return {"tolerance": self.tolerance, "tolerance_ratio": self.tolerance_ratio,
                "process_overhead": self.process_overhead, "context_allowance": self.context_allowance,
                "grace_s": self.grace, "window_s": self.window,
                "compute_margin": self.compute_margin, "require_slices": self.require_slices,
                "on_violation": {k: self.action(k) for k in KINDS}}


def parse_actions(values) -> dict:
    """`--on-violation` values: ACTION (every kind that has it) or KIND=ACTION, repeatable."""
    out = {}
    for v in values:
        kind, _, action = v.rpartition("=")
        kinds = [kind] if kind else [k for k in KINDS if action in ACTIONS[k]]
        if kind and kind not in KINDS:
            raise ValueError(f"{kind!r} is not a violation kind ({', '.join(KINDS)})")
        if not kinds or any(action not in ACTIONS[k] for k in kinds):
            raise ValueError(f"{v!r}: {action!r} is not an action for "
                             f"{kind or 'any kind'} (" + "; ".join(f"{k}: {'|'.join(ACTIONS[k])}" for k in
                                                                   ([kind] if kind else KINDS)) + ")")
        out.update({k: action for k in kinds})
    return out
