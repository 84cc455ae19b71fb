#!/usr/bin/env bash
# Sourced by launch/demo.sh and launch/test.sh: creates the project virtualenv (.venv, or
# $MT3D_VENV) on first use, installs mt3d with its test extras, and activates it.
# torch is installed first and pinned by launch/constraints.txt: on a CPU-only machine the pin
# resolves to the local 2.13.0 CPU wheel instead of the registry's newest multi-GB CUDA build.
# Re-running is cheap: the install is skipped while setup.cfg and the constraints are unchanged.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MT3D_VENV:-$ROOT/.venv}"
PYTHON_BIN="${PYTHON:-python3}"
CONSTRAINTS="$ROOT/launch/constraints.txt"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[mt3d] creating virtualenv $VENV"
  "$PYTHON_BIN" -m venv "$VENV" || { echo "[mt3d] error: '$PYTHON_BIN -m venv' failed (install python3-venv)" >&2; return 1; }
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

# libaio headers for DeepSpeed's async_io op (ZeRO-Infinity's NVMe offload and its tests): installed
# when we are root on a Debian/Ubuntu machine; otherwise the NVMe tests are skipped with a note.
if [ ! -e /usr/include/libaio.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[mt3d] installing libaio-dev (NVMe offload)"
  { apt-get install -y -qq libaio-dev >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 &&
      apt-get install -y -qq libaio-dev >/dev/null 2>&1; }; } ||
    echo "[mt3d] warning: could not install libaio-dev; NVMe offload tests will be skipped" >&2
fi

want="$(cat "$ROOT/setup.cfg" "$CONSTRAINTS" | sha256sum | cut -c1-16)"
stamp="$VENV/.mt3d-install-stamp"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[mt3d] installing torch (pinned) and mt3d[test] into $VENV (first run takes about a minute)"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  python -m pip install -q -c "$CONSTRAINTS" torch || return 1
  python -m pip install -q -c "$CONSTRAINTS" -e "$ROOT[test]" || return 1
  echo "$want" > "$stamp"
fi
# One thread per process unless the user says otherwise: tests and the demo run several ranks
# on few cores, and oversubscribed OpenMP makes pipeline steps 5-10x slower.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export WANDB_MODE="${WANDB_MODE:-offline}"
export DS_ACCELERATOR="${DS_ACCELERATOR:-$(command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)}"
