#!/usr/bin/env bash
# Image build step 1 (the Dockerfile's build stage RUNs it; tests/deploy/test_image_steps.py runs
# it too): build the vgpu wheel, which compiles the shim and simgpu into vgpu/_lib/, and
# check that they are in it.
#
# usage: tools/image/build-wheel.sh SRC OUT
#   SRC  a vgpu source tree (a checkout, or the Docker build context)
#   OUT  directory for the wheel (earlier vgpu-*.whl there are removed first)
# env:
#   PYTHON                 interpreter to build with (default: python3)
#   VGPU_BUILD_ISOLATION   1 (default): pip fetches setuptools/wheel/cffi into an isolated
#                          build env; 0: use the calling environment's (offline, CI)
#   CC                     C compiler (default: cc)
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 SRC OUT" >&2
    exit 2
fi
src=$(cd "$1" && pwd)
mkdir -p "$2"
out=$(cd "$2" && pwd)
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)

# Build from a clean copy of what the package needs: never from (or into) the source
# tree, whose build/ and compiled libraries may belong to a developer's editable install.
stage=$(mktemp -d "${TMPDIR:-/tmp}/vgpu-wheel.XXXXXX")
trap 'rm -rf "$stage"' EXIT
(cd "$src" && tar -cf - \
    --exclude=__pycache__ --exclude='*.so' --exclude='*.so.1' --exclude='*.o' \
    --exclude='*.egg-info' --exclude='src/vgpu/_lib' --exclude='src/vgpu/_region*.c' \
    pyproject.toml setup.py MANIFEST.in README.md src csrc simgpu shim tools) | tar -xf - -C "$stage"

isolation=()
if [ "${VGPU_BUILD_ISOLATION:-1}" = 0 ]; then
    isolation=(--no-build-isolation)
fi
rm -f "$out"/vgpu-*.whl
"$python" -m pip wheel --no-deps "${isolation[@]}" --wheel-dir "$out" "$stage"

shopt -s nullglob
wheels=("$out"/vgpu-*.whl)
if [ ${#wheels[@]} -ne 1 ]; then
    echo "$0: expected one vgpu wheel in $out, found ${#wheels[@]}" >&2
    exit 1
fi
"$python" "$here/check-wheel.py" "${wheels[0]}"
