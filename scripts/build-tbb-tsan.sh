#!/usr/bin/env bash
# Builds oneTBB from Debian's own source package with ThreadSanitizer instrumentation
# (TBB_SANITIZE=thread) into build-tsan/onetbb, so that TSan sees the happens-before edges of
# TBB's spawn/steal/join/enqueue. scripts/tsan.sh uses it when present.
# Same version as the libtbb-dev the project builds against (Debian 12: 2021.8).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=$PWD/build-tsan/onetbb
src=$PWD/build-tsan/onetbb-src
[ -f "$dest/lib/cmake/TBB/TBBConfig.cmake" ] && { echo "build-tbb-tsan: $dest exists"; exit 0; }
mkdir -p "$src"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
# Source packages need a deb-src entry; add one beside the binary entries if there is none.
if ! grep -rqs "deb-src" /etc/apt/sources.list /etc/apt/sources.list.d/; then
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    $SUDO sed -i 's/^Types: deb$/Types: deb deb-src/' /etc/apt/sources.list.d/debian.sources
  else
    grep -h "^deb " /etc/apt/sources.list | sed 's/^deb /deb-src /' | $SUDO tee /etc/apt/sources.list.d/towers-src.list
  fi
  $SUDO apt-get update -qq
fi
version=$(dpkg-query -W -f='${source:Upstream-Version}' libtbb-dev)
(cd "$src" && apt-get source --download-only "onetbb=$(dpkg-query -W -f='${Version}' libtbb-dev)" >/dev/null)
tar -xJf "$src"/onetbb_"$version".orig.tar.xz -C "$src"
tree=$(find "$src" -mindepth 1 -maxdepth 1 -type d -iname 'onetbb-[0-9]*' | head -1)
nice -n 10 cmake -S "$tree" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTBB_SANITIZE=thread -DTBB_TEST=OFF -DTBB_EXAMPLES=OFF -DTBBMALLOC_BUILD=OFF \
  -DTBB_STRICT=OFF -DCMAKE_INSTALL_PREFIX="$dest"
nice -n 10 cmake --build "$src/build" -j "$(nproc)"
cmake --install "$src/build" >/dev/null
echo "build-tbb-tsan: installed $dest"
