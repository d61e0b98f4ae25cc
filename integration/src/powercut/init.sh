#!/bin/busybox sh
# /init of the power-cut guest (integration::powercut): mounts the disk
# under test (/dev/vda) at /mnt, runs the one command the kernel command line
# names (pc.run=, its words separated by commas), unmounts and powers off.
# Every line the harness reads starts with "PC-".
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs run /run
mount -t tmpfs tmp /tmp

fail() {
    echo "PC-FAIL $*"
    poweroff -f
}

for m in $(cat /etc/modules.order); do
    insmod "/lib/modules/$m" || fail "insmod $m"
done

run=""
for word in $(cat /proc/cmdline); do
    case "$word" in
        pc.run=*) run="${word#pc.run=}" ;;
    esac
done
[ -n "$run" ] || fail "no pc.run= on the kernel command line"

i=0
while [ ! -b /dev/vda ]; do
    i=$((i + 1))
    [ "$i" -gt 100 ] && fail "no /dev/vda"
    sleep 0.05
done
mount -t btrfs /dev/vda /mnt || fail "mount /dev/vda"

echo "PC-GO $(cut -d' ' -f1 /proc/uptime)"
# shellcheck disable=SC2086
$(echo "$run" | tr ',' ' ') >/tmp/out 2>&1
rc=$?
echo "PC-RC $rc $(cut -d' ' -f1 /proc/uptime)"
sed 's/^/PC-OUT /' /tmp/out
umount /mnt || fail "umount /mnt"
echo "PC-END"
poweroff -f
