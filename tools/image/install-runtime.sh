#!/usr/bin/env bash
# Image build step 2 (the Dockerfile's final stage RUNs it; tests/deploy/test_image_steps.py runs
# it too): install the vgpu wheel into a virtual environment and check that vgpu-ctl runs
# and finds its shim.  Needs no compiler: the wheel carries the compiled libraries.
#
# usage: tools/image/install-runtime.sh WHEEL_DIR PREFIX [PIP_ARGS...]
#   WHEEL_DIR  holds exactly one vgpu-*.whl (from build-wheel.sh)
#   PREFIX     the virtual environment (created unless it exists); vgpu-ctl ends up in
#              PREFIX/bin
#   PIP_ARGS   extra `pip install` arguments (e.g. --no-deps --no-index)
# env: PYTHON  interpreter for the virtual environment (default: python3)
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 WHEEL_DIR PREFIX [PIP_ARGS...]" >&2
    exit 2
fi
wheel_dir=$1
prefix=$2
shift 2
python=${PYTHON:-python3}

shopt -s nullglob
wheels=("$wheel_dir"/vgpu-*.whl)
if [ ${#wheels[@]} -ne 1 ]; then
    echo "$0: expected one vgpu wheel in $wheel_dir, found ${#wheels[@]}" >&2
    exit 1
fi
if [ ! -x "$prefix/bin/python" ]; then
    "$python" -m venv "$prefix"
fi
"$prefix/bin/python" -m pip install "$@" "${wheels[0]}[k8s]"
prefix=$(cd "$prefix" && pwd -P)

# the checks the image is worth: the command runs, and the shim it would install is there
"$prefix/bin/vgpu-ctl" --version
shim=$("$prefix/bin/vgpu-ctl" shim-path)
case "$shim" in
    "$prefix"/*) ;;
    *) echo "$0: vgpu-ctl's shim $shim is not inside $prefix" >&2; exit 1 ;;
esac
test -f "$shim"
echo "shim: $shim"
"$prefix/bin/python" -c "import vgpu.k8s.plugin_main, vgpu.k8s.plugin"
echo "k8s-plugin: loads"
