"""The quota/usage file layout is the same in C and in the generated Python binding."""
import subprocess

from vgpu._region import ffi, lib

from tests.helpers.paths import CSRC

STRUCTS = ["struct vgpu_quota", "struct vgpu_quota_device", "struct vgpu_usage",
           "struct vgpu_usage_device", "struct vgpu_usage_proc"]


def test_every_field_offset_and_struct_size_match_what_c_compiles(tmp_path):
    lines, expected = [], []
    for s in STRUCTS:
        lines.append(f'printf("%zu\\n", sizeof({s}));')
        expected.append(ffi.sizeof(s))
        for name, _ in ffi.typeof(s).fields:
            lines.append(f'printf("%zu\\n", offsetof({s}, {name}));')
            expected.append(ffi.offsetof(s, name))
    src = tmp_path / "layout.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "vgpu_region.h"\n'
                   "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-std=gnu11", "-Wall", "-Werror", "-I", str(CSRC), str(src), "-o", str(exe)],
                   check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    assert [int(x) for x in out] == expected
    assert len(expected) > 40


def test_files_carry_magic_and_abi_version_constants():
    assert lib.VGPU_ABI_VERSION == 2
    assert lib.VGPU_QUOTA_MAGIC != lib.VGPU_USAGE_MAGIC
    # reserved space at the end lets later versions grow without moving fields
    assert ffi.offsetof("struct vgpu_quota", "reserved") + 29 * 8 == ffi.sizeof("struct vgpu_quota")
    # (the usage file's last 256 reserved bytes became charge_seq, one u32 a slot)
    assert ffi.offsetof("struct vgpu_usage", "charge_seq") + lib.VGPU_MAX_PROCS * 4 == ffi.sizeof("struct vgpu_usage")


def test_the_node_agent_s_fields_took_reserved_space_and_moved_nothing():
    """The temporary slice's owner (quota) and who a slot's process is (usage) were added
    within ABI 2: in what was reserved, so every older field stays where it was."""
    assert ffi.sizeof("struct vgpu_quota") == 1504
    assert ffi.offsetof("struct vgpu_quota", "owner_pid") == ffi.offsetof("struct vgpu_quota", "devices") + \
        lib.VGPU_MAX_DEVICES * ffi.sizeof("struct vgpu_quota_device")
    assert ffi.sizeof("struct vgpu_usage_proc") == 80
    assert [ffi.offsetof("struct vgpu_usage_proc", f) for f in ("start_ticks", "pid_ns", "cgroup_id", "flags")] == \
        [48, 56, 64, 72]
