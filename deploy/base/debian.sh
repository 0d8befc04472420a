#!/usr/bin/env bash
# Build the CPU profile's root image, localhost/flashmap/debian:bookworm, from Debian's packages:
# debootstrap into a scratch folder, then `podman import`. No image registry is needed.
#
#   sudo deploy/base/debian.sh                       # suite and mirror below
#   DEBIAN_SNAPSHOT=20261101T000000Z deploy/base/debian.sh   # a fixed day of the archive
#
# Pinned: the suite (bookworm, Debian 12), the variant and the package list. deb.debian.org serves
# the suite's current point release, so the package versions are those of the day of the build;
# set DEBIAN_SNAPSHOT to build from snapshot.debian.org's copy of one day instead (where that
# host is reachable) and get the same packages every time. The image records what it was built
# from: labels for suite, mirror and the Release file's date, and the installed package list in
# /usr/share/flashmap/debian-packages.txt.
set -euo pipefail

SUITE=bookworm
IMAGE=${FLASHMAP_DEBIAN_IMAGE:-localhost/flashmap/debian:$SUITE}
if [ -n "${DEBIAN_SNAPSHOT:-}" ]; then
  MIRROR=https://snapshot.debian.org/archive/debian/$DEBIAN_SNAPSHOT
else
  MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
fi
# Debian's Python 3.11 (the wheels in deploy/requirements/cpu.lock are cp311), venv for pip, and
# libpython3.11 for Triton's Python backend stub, which links it.
PACKAGES=python3,python3-venv,libpython3.11

[ "$(id -u)" = 0 ] || { echo "debian.sh: debootstrap needs root" >&2; exit 1; }
rootfs=$(mktemp -d /var/tmp/flashmap-debian.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT

debootstrap --variant=minbase --include="$PACKAGES" \
  --keyring=/usr/share/keyrings/debian-archive-keyring.gpg \
  "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log" >&2; exit 1; }
rm -f "$rootfs.log"

release_date=$(date -u -d "$(sed -n 's/^Date: //p' "$rootfs"/var/lib/apt/lists/*_dists_${SUITE}_Release | head -1)" +%Y-%m-%dT%H:%M:%SZ)
mkdir -p "$rootfs/usr/share/flashmap"
chroot "$rootfs" dpkg-query -W -f '${Package}=${Version}\n' >"$rootfs/usr/share/flashmap/debian-packages.txt"
# What an image does not need: downloaded packages and indexes, documentation, translations.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*

tar -C "$rootfs" --numeric-owner -c . | podman import \
  --change 'ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV=LANG=C.UTF-8' \
  --change 'CMD=["/bin/bash"]' \
  --change "LABEL=org.opencontainers.image.base.name=debian:$SUITE" \
  --change "LABEL=io.flashmap.debian.mirror=$MIRROR" \
  --change "LABEL=io.flashmap.debian.release-date=$release_date" \
  --quiet - "$IMAGE" >/dev/null
echo "$IMAGE: Debian $SUITE from $MIRROR (Release of $release_date), $(wc -l <"$rootfs/usr/share/flashmap/debian-packages.txt") packages"
