#!/usr/bin/env bash
# Installs kvsim's build dependencies from Debian's archive (as root, Debian 12) and builds it
# into ./build. Safe to run again: it installs only what is missing and rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")"

# gnuplot-nox draws `kvsim report`'s figures (its rendering tests skip without it).
packages=(g++ meson ninja-build pkg-config python3 libyaml-cpp-dev libeigen3-dev libtbb-dev libhdf5-dev zlib1g-dev libdeflate-dev
          libcli11-dev doctest-dev nettle-dev libicu-dev
          nlohmann-json3-dev gnuplot-nox)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "bootstrap: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -f build/build.ninja ]; then
    meson setup build --buildtype=release
fi
ninja -C build
