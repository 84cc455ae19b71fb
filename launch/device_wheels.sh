#!/usr/bin/env bash
# Wheels for a lent GPU machine (the device tool), whose image has torch, transformers, accelerate,
# safetensors and ninja but not DeepSpeed or its pure-Python needs, and which reaches no registry.
# Run here, in the repository root, with the project's venv active; then every device call names
# `.whl` in `carry` and begins with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
# DeepSpeed is published as a source archive only: it is built into a wheel here, without build
# isolation (an isolated build would fetch the registry's newest CUDA torch) and with no op
# prebuilt (DeepSpeed builds the ones it needs on first use, as on this machine).
set -euo pipefail
out=.whl
mkdir -p "$out"
grep -qx '/.whl/' .gitignore || { echo "add /.whl/ to .gitignore first" >&2; exit 1; }
python -c 'import torch' || { echo "activate the project's venv (it holds torch, needed to build DeepSpeed)" >&2; exit 1; }
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w "$out" deepspeed==0.19.8
version() { python -m pip show "$1" | sed -n 's/^Version: //p'; }
# the versions this venv runs DeepSpeed with; the device's Python is 3.12 on x86-64
for pkg in hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$out" "$pkg==$(version "$pkg")"
done
ls -la "$out"
du -sh "$out"
