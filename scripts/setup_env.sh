#!/usr/bin/env bash
# Create .venv (if needed) and install the project with its dev tools. Sourced by scripts/test
# and scripts/demo. Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
stamp="$venv/.featcal-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # torch first, pinned: on the project machines these two come from the local disk
  "$venv/bin/python" -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
  "$venv/bin/python" -m pip install --quiet -e "$root[dev]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
# offline and quiet: the tools must not phone home
export HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1 MLFLOW_DISABLE_TELEMETRY=true
export PREFECT_SERVER_ANALYTICS_ENABLED=false DVC_NO_ANALYTICS=1
