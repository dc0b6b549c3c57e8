#!/bin/sh
# The kernel matrix's /init (busybox, in a small initramfs that `cargo xtask matrix` builds for each
# kernel): loads the kernel's own 9p, virtio and overlay modules, mounts the host's root filesystem
# (9p, read-only) under a tmpfs overlay so the tests can write, and runs tests/matrix/guest.sh there
# as root. Everything goes to the serial console; the host reads the MATRIX-* lines.
# $MATRIX_GUEST and $MATRIX_PLAN come from the kernel command line.
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev /host /rw /newroot
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
fail() { echo "MATRIX-INIT-FAILED $*"; echo MATRIX-END; poweroff -f; }
for module in $(cat /modules/order); do
  insmod "/modules/$module" || echo "MATRIX-INIT insmod $module failed"
done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose host /host \
  || fail "mounting the host's root over 9p"
mount -t tmpfs -o size=80% scratch /rw && mkdir -p /rw/upper /rw/work || fail "mounting the scratch tmpfs"
mount -t overlay -o lowerdir=/host,upperdir=/rw/upper,workdir=/rw/work overlay /newroot \
  || fail "mounting the overlay of the host's root"
n=/newroot
mount -t proc proc $n/proc && mount -t sysfs sys $n/sys && mount -t devtmpfs dev $n/dev || fail "mounting /proc, /sys, /dev"
mkdir -p $n/dev/pts $n/dev/shm
mount -t devpts devpts $n/dev/pts; mount -t tmpfs shm $n/dev/shm
mount -t tmpfs tmp $n/tmp; mount -t tmpfs run $n/run
mount -t debugfs debugfs $n/sys/kernel/debug; mount -t tracefs tracefs $n/sys/kernel/tracing
mount -t bpf bpf $n/sys/fs/bpf; mount -t cgroup2 cgroup2 $n/sys/fs/cgroup
echo "MATRIX-BOOTED"
# A copy: bash reads a script as it runs, and the host's may be edited meanwhile.
cp "$n$MATRIX_GUEST" $n/tmp/matrix-guest.sh || fail "reading $MATRIX_GUEST from the host"
chroot $n /bin/bash /tmp/matrix-guest.sh "$MATRIX_PLAN"
echo "MATRIX-GUEST-RC $?"
echo MATRIX-END
sync
poweroff -f
