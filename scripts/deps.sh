#!/usr/bin/env bash
# Installs the Debian packages fsdp needs (idempotent: skips apt when everything is present).
set -euo pipefail
packages=(
  build-essential cmake make ccache pkg-config clang libclang-rt-14-dev
  libtorch-dev libopenblas0-pthread
  libopenmpi-dev openmpi-bin
  libhdf5-openmpi-dev hdf5-tools
  libboost-test-dev libtomlplusplus-dev libcli11-dev nlohmann-json3-dev zlib1g-dev
  dataset-fashion-mnist
  gnuplot-nox python3-torch
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
