"""What the agent has prepared, on disk, so a restarted agent can still unprepare it.

A JSON file in the plugin directory, replaced atomically on every change:

    {"version": 1, "claims": {UID: {"namespace", "name", "state", "slice", "cdi_spec", "devices"}}}

`state` is "preparing" from just before the slice and spec are made until the claim is
ready, then "prepared": an agent that died half-way finds what it may have left behind.
A file that cannot be read is never overwritten (it would forget prepared claims): the
agent refuses to start and says where the file is.
"""
import json
import os

from .. import install

VERSION = 1


class CheckpointError(Exception):
    def __init__(self, message, hint=None):
        super().__init__(message)
        self.hint = hint


def load(path: str) -> dict:
    """claim UID -> entry; {} when there is no checkpoint yet."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be read: {e}",
                              "inspect it; move it aside to start empty (claims it lists then need "
                              "`vgpu-ctl delete` by hand)") from None
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("claims"), dict):
        raise CheckpointError(f"checkpoint {path} is not a version {VERSION} vgpu checkpoint",
                              "move it aside to start empty (claims it lists then need `vgpu-ctl delete` by hand)")
    return data["claims"]


def save(path: str, claims: dict):
    """Replace the file atomically (written aside, fsynced, renamed)."""
    directory, name = os.path.split(path)
    os.makedirs(directory or ".", 0o755, exist_ok=True)
    data = json.dumps({"version": VERSION, "claims": claims}, indent=1, sort_keys=True).encode()
    install.place(directory or ".", name, data, 0o600)
