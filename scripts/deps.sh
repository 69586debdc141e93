#!/usr/bin/env bash
# Installs the Debian packages fsdp needs. Every build runs it (make build, run, test, bench), so it is
# idempotent and silent when everything is present: apt runs only for what is missing.
set -euo pipefail
packages=(
  build-essential cmake make ccache pkg-config clang clang-format libclang-rt-14-dev
  libtorch-dev libopenblas0-pthread libjemalloc-dev
  libopenmpi-dev openmpi-bin
  libhdf5-openmpi-dev hdf5-tools
  libboost-test-dev libtomlplusplus-dev libcli11-dev nlohmann-json3-dev zlib1g-dev libicu-dev python3-regex
  dataset-fashion-mnist
  gnuplot-nox python3-torch
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
((${#missing[@]} == 0)) && exit 0
echo "deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
