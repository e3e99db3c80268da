#!/usr/bin/env bash
# The Python packages train.py needs that the lent GPU machines' image lacks (its list: the device library's
# KINDS.md), as wheels for its Python 3.12, in .whl/ (git-ignored, about 6 MB) — the versions installed here, so the
# GPU runs the code CI tests; typing-extensions too, since pydantic-core needs a recent one (its Sentinel) and the
# image's version is not known. Run here, where pip reaches an index; then carry .whl to the device
# (benchmarks/gpu_session.sh installs them there). Checked with Python 3.12.1's pip: they install with --target
# and pydantic imports. The wheels are made in a staging folder and replace .whl/ only when all of them are there: a
# Python without the packages, or a download that fails, leaves the .whl/ that was there.
set -euo pipefail
cd "$(dirname "$0")/.."
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
NAMES=(hjson datasets dill multiprocess pydantic pydantic-core annotated-types typing-inspection typing-extensions)
for name in deepspeed "${NAMES[@]}"; do     # before anything is made or removed
    version "$name" >/dev/null 2>&1 || {
        echo "gpu_wheels.sh: $(python3 --version 2>&1) here has no $name: run it where 'pip install -e .' ran" >&2
        exit 2; }
done
DEST=.whl
STAGING=$(mktemp -d .whl.staging.XXXXXX)
trap 'rm -rf "$STAGING"' EXIT
# DeepSpeed is published as a source archive only: build its (pure-Python) wheel, no ops compiled ahead
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation "deepspeed==$(version deepspeed)" -w "$STAGING"
PACKAGES=()
for name in "${NAMES[@]}"; do
    PACKAGES+=("$name==$(version "$name")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$STAGING" "${PACKAGES[@]}"
rm -rf "$DEST" && mv "$STAGING" "$DEST"
ls -l "$DEST"
