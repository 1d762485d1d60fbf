"""The container image's build steps, run here because CI has no Docker engine.

The Dockerfile is parsed, not built: the tests check its shape (multi-stage, no compiler
in the final stage, a non-root USER, OCI labels, vgpu-ctl as entrypoint) and then run the
RUN lines that call tools/image/*.sh — taken from the Dockerfile itself, with its image
paths mapped to temporary directories — so the steps the image runs are the steps tested.
Offline: the wheel is built with this environment's setuptools/cffi
(VGPU_BUILD_ISOLATION=0) and the fresh virtual environment borrows this one's
dependencies instead of downloading them.
"""
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

DOCKERFILE = ROOT / "Dockerfile"
BUILD_WHEEL = "tools/image/build-wheel.sh"
INSTALL_RUNTIME = "tools/image/install-runtime.sh"
LIBS = ("vgpu/_lib/libvgpu.so", "vgpu/_lib/simgpu/libcuda.so.1", "vgpu/_lib/simgpu/libnvidia-ml.so.1")
COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|cc|build-essential|make|libc6-dev|binutils)\b")


# === reading the Dockerfile ===

def instructions(text):
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages(text):
    """[{"name", "base", "steps": [(INSTRUCTION, args)]}], in order."""
    result = []
    for word, args in instructions(text):
        if word == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            result.append({"name": name, "base": parts[0], "steps": []})
        elif result:
            result[-1]["steps"].append((word, args))
    return result


def run_commands(stage):
    """The shell commands of a stage's RUN lines, BuildKit --mount flags removed."""
    return [re.sub(r"--mount=\S+\s*", "", args) for word, args in stage["steps"] if word == "RUN"]


@pytest.fixture(scope="module")
def dockerfile():
    return stages(DOCKERFILE.read_text())


def test_dockerfile_has_a_build_stage_and_a_final_stage(dockerfile):
    assert len(dockerfile) == 2
    build, final = dockerfile
    assert build["name"] == "build" and final["name"] == "runtime"
    assert build["base"] == final["base"] == "${PYTHON_IMAGE}"
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.\d+-slim", DOCKERFILE.read_text(), re.M)
    assert any(COMPILERS.search(c) for c in run_commands(build))      # the compiler lives here ...


def test_final_stage_has_no_compiler_and_runs_vgpu_ctl_as_a_non_root_user(dockerfile):
    final = dockerfile[-1]
    steps = final["steps"]
    for cmd in run_commands(final):                                   # ... and not here
        assert "apt-get install" not in cmd and "apk add" not in cmd, cmd
        assert not COMPILERS.search(cmd.replace("tools/image", "")), cmd
    users = [args for word, args in steps if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    entry = [json.loads(args) for word, args in steps if word == "ENTRYPOINT"]
    assert entry == [["vgpu-ctl"]]                                     # exec form, no shell
    labels = " ".join(args for word, args in steps if word == "LABEL")
    for key in ("title", "description", "version", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels
    env = " ".join(args for word, args in steps if word == "ENV")
    assert "PATH=/opt/venv/bin:$PATH" in env and "VGPU_DIR=/run/vgpu" in env
    copied = [args for word, args in steps if word == "COPY"]
    assert copied == []          # the wheel and the script come in through mounts: no leftover layers


def test_each_stage_runs_the_scripts_these_tests_run(dockerfile):
    build, final = dockerfile
    assert [c for c in run_commands(build) if "tools/image" in c] == [f"/src/{BUILD_WHEEL} /src /dist"]
    assert [c for c in run_commands(final) if "/tmp/image" in c] == [
        "PIP_NO_CACHE_DIR=1 /tmp/image/install-runtime.sh /tmp/dist /opt/venv"]
    mounts = " ".join(args for word, args in final["steps"] if word == "RUN")
    assert "--mount=type=bind,from=build,source=/dist,target=/tmp/dist" in mounts
    assert "--mount=type=bind,source=tools/image,target=/tmp/image" in mounts
    for script in (BUILD_WHEEL, INSTALL_RUNTIME, "tools/image/check-wheel.py"):
        assert (ROOT / script).is_file()
    for script in (BUILD_WHEEL, INSTALL_RUNTIME):
        assert os.access(ROOT / script, os.X_OK), f"{script} must be executable"


def test_dockerignore_keeps_build_outputs_out_of_the_context():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "build", "src/vgpu/_lib", "**/*.so"} <= ignored


# === running the steps ===

def mapped(cmd, paths):
    """cmd with each image path replaced by its local stand-in (longest prefix first)."""
    out = []
    for token in shlex.split(cmd):
        for image_path in sorted(paths, key=len, reverse=True):
            if token == image_path or token.startswith(image_path + "/"):
                token = str(paths[image_path]) + token[len(image_path):]
                break
        out.append(token)
    return out


def run_step(argv, env_extra):
    env = {**os.environ, "PYTHON": sys.executable, **env_extra}
    env.pop("PYTHONPATH", None)
    assign = []
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):   # VAR=value before the command
        assign.append(argv.pop(0))
    env.update(a.split("=", 1) for a in assign)
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{argv} -> {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def built(dockerfile, tmp_path_factory):
    """The build stage's step: the wheel, built from this checkout."""
    tmp = tmp_path_factory.mktemp("image")
    (cmd,) = [c for c in run_commands(dockerfile[0]) if BUILD_WHEEL in c]
    out = run_step(mapped(cmd, {"/src": ROOT, "/dist": tmp / "dist"}), {"VGPU_BUILD_ISOLATION": "0"})
    (wheel,) = (tmp / "dist").glob("vgpu-*.whl")
    return tmp, wheel, out.stdout


def test_build_step_puts_the_shim_and_simgpu_in_the_wheel(built):
    tmp, wheel, log = built
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        assert set(LIBS) <= names
        assert all(zf.read(lib)[:4] == b"\x7fELF" for lib in LIBS)
    assert "vgpu/cli/__init__.py" in names and any(n.endswith("entry_points.txt") for n in names)
    assert re.search(r"vgpu/_lib/libvgpu\.so: \d+ bytes, needs glibc >= 2\.\d+", log)   # check-wheel.py ran


def test_check_wheel_refuses_a_wheel_without_the_shim(tmp_path, built):
    _, wheel, _ = built
    broken = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(broken, "w") as dst:
        for item in src.infolist():
            if item.filename != "vgpu/_lib/libvgpu.so":
                dst.writestr(item, src.read(item))
    out = subprocess.run([sys.executable, str(ROOT / "tools/image/check-wheel.py"), str(broken)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "vgpu/_lib/libvgpu.so missing" in out.stderr


def borrow_dependencies(venv):
    """Let the fresh venv import vgpu's dependencies from this environment (no download);
    vgpu itself must come from the wheel (this environment's copy is an editable install,
    whose import hook a .pth path line does not activate)."""
    dirs = []
    for mod in ("click", "cffi", "_cffi_backend", "psutil", "pynvml", "pycparser"):
        spec = importlib.util.find_spec(mod)
        if spec and spec.origin:
            site = Path(spec.origin).parent if spec.submodule_search_locations is None else \
                Path(spec.origin).parent.parent
            if str(site) not in dirs:
                dirs.append(str(site))
    (site_dir,) = venv.glob("lib/python3*/site-packages")
    (site_dir / "borrowed-deps.pth").write_text("\n".join(dirs) + "\n")


def test_install_step_gives_a_working_vgpu_ctl_without_a_compiler(dockerfile, built, tmp_path):
    tmp, wheel, _ = built
    venv = tmp_path / "opt-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    borrow_dependencies(venv)
    (cmd,) = [c for c in run_commands(dockerfile[-1]) if "install-runtime.sh" in c]
    argv = mapped(cmd, {"/tmp/image": ROOT / "tools/image", "/tmp/dist": wheel.parent, "/opt/venv": venv})
    out = run_step(argv + ["--no-deps", "--no-index", "--ignore-installed"], {"CC": "false"})
    assert re.search(r"^vgpu-ctl \S+, shim ABI \d+$", out.stdout, re.M) and "k8s-plugin: loads" in out.stdout
    ctl = str(venv / "bin" / "vgpu-ctl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
    version = subprocess.run([ctl, "--version"], capture_output=True, text=True, env=env, check=True)
    assert re.fullmatch(r"vgpu-ctl \S+, shim ABI \d+\n", version.stdout)
    shim = Path(subprocess.run([ctl, "shim-path"], capture_output=True, text=True, env=env,
                               check=True).stdout.strip())
    assert shim.is_file() and shim.is_relative_to(venv.resolve())
    with zipfile.ZipFile(wheel) as zf:
        assert shim.read_bytes() == zf.read("vgpu/_lib/libvgpu.so")
    # the image's first job on a node: put the shim in a host directory
    dest = tmp_path / "host-opt-vgpu"
    subprocess.run([ctl, "install-shim", str(dest), "--preload-file"], check=True, env=env, capture_output=True)
    assert (dest / "libvgpu.so").read_bytes() == shim.read_bytes()
