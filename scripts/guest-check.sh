#!/usr/bin/env bash
# A node with a kernel of its own (issue 43, its first step): a Debian 12 guest made with mmdebstrap
# (systemd as PID 1, cgroup v2, Debian's 6.1 kernel, the CRIU scripts/install-criu.sh built on this
# machine and the libraries it links), booted by QEMU with KVM where KVM runs a Linux kernel, else
# with QEMU's TCG (an emulator: correct, not fast). Inside it, at boot: the cgroup layout, PID 1,
# `criu check`, userfaultfd (post-copy), a process dumped and restored that goes on counting, the
# layout as criuctl names it, a helper leaving a cgroup namespace of its own (cgroup v2, nsdelegate),
# and a restore into another cgroup (a placeholder's) by the unified hierarchy's root. Then two
# guests as nodes a and b: criuctl's host move, and a container's move between two containerd 2s
# with runc's systemd cgroup driver and CDI on (scripts/guest_pods.py), each beside the same move
# between two namespace nodes on this machine.
# Not run by `make test` (~13 min here: a guest image, two guests under TCG); it writes what it found to
# bench/results/guest-check.json, with the commit it ran on.
#   sudo scripts/guest-check.sh [WORKDIR]      (default /var/tmp/criuctl-guest; rebuilt each run)
set -euo pipefail
log() { echo "guest-check: $*" >&2; }
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap --mode=root, a loop-free ext4 image, /dev/kvm)"
criu=$(command -v criu) || die "no criu here: run make test (or scripts/install-criu.sh) first"
command -v mmdebstrap >/dev/null || apt_install mmdebstrap
command -v qemu-system-x86_64 >/dev/null || apt_install qemu-system-x86
work=${1:-/var/tmp/criuctl-guest}
commit=$(git describe --always --dirty 2>/dev/null || echo unknown)  # what the guests get, copied below
# rebuilt each run: only ever a folder this script made (its marker), never one a typo names
if [ -e "$work" ]; then
  [ -f "$work/.criuctl-guest" ] || [ -z "$(ls -A "$work" 2>/dev/null)" ] || die "$work exists and is not a guest-check folder: name a new or empty one"
  rm -rf --one-file-system "$work"
fi
mkdir -p "$work" && touch "$work/.criuctl-guest"
root=$work/root

# the packages of the libraries criu links (glibc's is in every guest), as dpkg names them
libs=$(ldd "$criu" | awk '/=> \// {print $3}' | while read -r lib; do
  dpkg -S "*/$(basename "$lib")" 2>/dev/null | head -1 | cut -d: -f1 || true
done | grep -v '^libc6$' | sort -u | paste -sd,)
log "building the guest (Debian 12, systemd, kernel, $libs)"
mmdebstrap --variant=apt --mode=root --quiet \
  --include="linux-image-amd64,initramfs-tools,systemd-sysv,udev,dbus,iproute2,kmod,procps,python3,nftables,runc,$libs" \
  --customize-hook='echo guest > "$1/etc/hostname"; echo "/dev/vda / ext4 rw 0 1" > "$1/etc/fstab"' \
  --customize-hook='printf "127.0.0.1 localhost\n::1 localhost\n" > "$1/etc/hosts"; : > "$1/etc/resolv.conf"' \
  --customize-hook='ln -sf /dev/null "$1/etc/systemd/system/serial-getty@ttyS0.service"' \
  bookworm "$root" "$(debian_uri)" >"$work/mmdebstrap.log" 2>&1 || die "mmdebstrap failed: see $work/mmdebstrap.log"
cp "$criu" "$root/usr/local/sbin/criu"
# criuctl's cgroup code needs only Python's standard library: the guest's python3 runs it
mkdir -p "$root/opt/criuctl/criuctl/container"
cp criuctl/__init__.py "$root/opt/criuctl/criuctl/"
cp criuctl/container/__init__.py criuctl/container/cgroups.py criuctl/container/mounts.py \
  "$root/opt/criuctl/criuctl/container/"

# the checks, each a `key: value` line in /root/check.txt, read back from the image after poweroff
cat >"$root/root/check.sh" <<'EOF'
#!/bin/sh
grep -q 'criuctl.node=' /proc/cmdline && exec /root/node.sh  # the move's guests (below)
exec >/root/check.txt 2>&1
say() { echo "$1: $2"; }
say kernel "$(uname -r)"
say cgroup "$(stat -fc %T /sys/fs/cgroup)"
say pid1 "$(ps -p 1 -o comm=)"
say criu "$(/usr/local/sbin/criu --version | head -1)"
/usr/local/sbin/criu check >/dev/null 2>&1 && say criu_check ok || say criu_check failed
/usr/local/sbin/criu check --feature uffd-noncoop >/dev/null 2>&1 && say uffd ok || say uffd missing
mkdir -p /tmp/img
setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i >/tmp/count; sleep 0.2; done' </dev/null >/dev/null 2>&1 &
sleep 1
pid=$(pgrep -f 'while :' | head -1)
if /usr/local/sbin/criu dump -t "$pid" -D /tmp/img --shell-job -o dump.log; then
  sleep 1; before=$(cat /tmp/count)
  if /usr/local/sbin/criu restore -D /tmp/img --shell-job -d -o restore.log; then
    sleep 1.5; after=$(cat /tmp/count)
    [ "$after" -gt "$before" ] && say dump_restore "ok (counted $before, then $after after its restore)" \
      || say dump_restore "restored but stopped at $after"
  else say dump_restore "restore failed: $(tail -1 /tmp/img/restore.log)"; fi
else say dump_restore "dump failed: $(tail -1 /tmp/img/dump.log)"; fi
# criuctl's view of the layout (what `criuctl doctor` says), then a helper in a cgroup namespace of
# its own, as in an agent's container on cgroup v2: nsdelegate keeps it in; it enters the node's
# namespace and leaves (criuctl.container.cgroups)
cd /opt/criuctl
say layout "$(python3 -m criuctl.container.cgroups)"
mkdir -p /sys/fs/cgroup/ctr
say cgroupns_escape "$(python3 - <<'PY' 2>&1 | tail -1
import ctypes, os
from criuctl.container import cgroups
mine = lambda: open("/proc/self/cgroup").read().strip()
open("/sys/fs/cgroup/ctr/cgroup.procs", "w").write(str(os.getpid()))
assert ctypes.CDLL(None, use_errno=True).unshare(0x02000000) == 0, "unshare"
inside = mine()
fd = os.open("/sys/fs/cgroup/cgroup.procs", os.O_WRONLY)
try:
    os.write(fd, str(os.getpid()).encode())  # unbuffered: a refusal raises here, not in a finalizer
    refused = "not refused"
except OSError as exc:
    refused = f"refused ({os.strerror(exc.errno)})"
os.close(fd)
assert not cgroups.leave_container() and cgroups.enter_node_namespace(), "enter"
seen = mine()
assert cgroups.leave_container(), "leave"
print(f"ok (in a namespace of its own: {inside}, a move to the root {refused}; in the node's: {seen}, then {mine()})")
PY
)"
cd /
# a restore into another cgroup, as into a placeholder's: the unified hierarchy's root for every
# controller (CRIU's --cgroup-root PATH; criuctl passes a cg_root without a controller)
mkdir -p /sys/fs/cgroup/src /sys/fs/cgroup/ph /tmp/cg
setsid sh -c 'echo $$ >/sys/fs/cgroup/src/cgroup.procs; exec sleep 1000' </dev/null >/dev/null 2>&1 &
sleep 0.5
if /usr/local/sbin/criu dump -t $! -D /tmp/cg --shell-job -o dump.log &&
  /usr/local/sbin/criu restore -D /tmp/cg --shell-job -d --manage-cgroups=soft --cgroup-root /ph -o restore.log \
    --pidfile /tmp/cg/pid; then
  say cgroup_root "restored into $(cut -d: -f3 "/proc/$(cat /tmp/cg/pid)/cgroup") (dumped in /src)"
else say cgroup_root "failed: $(tail -1 /tmp/cg/restore.log 2>/dev/null || tail -1 /tmp/cg/dump.log)"; fi
say done yes
sync
systemctl poweroff
EOF
chmod +x "$root/root/check.sh"
cat >"$root/etc/systemd/system/guest-check.service" <<'EOF'
[Unit]
Description=criuctl guest check
After=multi-user.target
[Service]
Type=oneshot
ExecStart=/root/check.sh
[Install]
WantedBy=multi-user.target
EOF
ln -sf /etc/systemd/system/guest-check.service "$root/etc/systemd/system/multi-user.target.wants/"
cp "$root"/boot/vmlinuz-* "$work/vmlinuz" && cp "$root"/boot/initrd.img-* "$work/initrd.img"

# boot: a fresh image each time (the check writes into it); DONE when the guest wrote its last line
boot() {
  local name=$1 seconds=$2 started
  shift 2
  rm -f "$work/disk.img" && truncate -s 4G "$work/disk.img" && mkfs.ext4 -q -F -d "$root" "$work/disk.img"
  started=$(date +%s.%N)
  timeout "$seconds" qemu-system-x86_64 "$@" -m 2048 -smp 2 -nographic -no-reboot \
    -kernel "$work/vmlinuz" -initrd "$work/initrd.img" -append "root=/dev/vda rw console=ttyS0 quiet" \
    -drive "file=$work/disk.img,format=raw,if=virtio" -nic none >"$work/$name.log" 2>&1 || true
  echo "seconds: $(echo "$(date +%s.%N) - $started" | bc)" >"$work/$name.txt"
  debugfs -R "cat /root/check.txt" "$work/disk.img" 2>/dev/null >>"$work/$name.txt" || true
  grep -q '^done: yes' "$work/$name.txt"
}

accel=kvm why_not_kvm=""
if [ ! -w /dev/kvm ]; then
  why_not_kvm="no writable /dev/kvm"
elif ! boot kvm 90 -enable-kvm -cpu host; then
  why_not_kvm="/dev/kvm opens and runs the BIOS, but the guest's kernel did not boot within 90 s"
  why_not_kvm+=" (its console's last words: $(tr -d '\r' <"$work/kvm.log" | sed 's/\x1b[^a-zA-Z]*[a-zA-Z]//g' \
    | grep -av -e '^[[:space:]]*$' -e '^qemu-system' | tail -1 | cut -c1-120))"
fi
if [ -n "$why_not_kvm" ]; then
  log "KVM: $why_not_kvm; booting with TCG"
  accel=tcg
  boot tcg 600 -accel tcg,thread=multi -cpu max || die "the guest did not finish its checks under TCG either: see $work/tcg.log"
fi

# ------------------------------------------------------------------ a move between two guests
# Two guests from one image (each its own copy-on-write view: QEMU's snapshot=on), nodes a and b,
# on an Ethernet of their own (QEMU's socket netdev: a joined to b, nothing else on it), each with
# this machine's Python and the project's venv at the same paths and criuctl's agent. On a: a
# reference run, then the same job under `criuctl run`, moved by `criuctl migrate` to b. On b: the
# job's end. Then the same for a pod's container (scripts/guest_pods.py): b's placeholder is ready
# before b's agent answers, a's job is moved by `criuctl migrate ctr-…` (its default mode). Their console lines `RESULT NODE KEY: VALUE` are what the host reads.
move=$work/move.txt
: >"$move"
venv=$(pwd)/.venv
python=$(readlink -f "$venv/bin/python")
pyhome=$(cd "$(dirname "$python")/.." && pwd)
job=${GUEST_JOB:-train_mlp.py --steps 60 --step-time 0.3}
pod_steps=${GUEST_POD_STEPS:-40}  # the container move's job: tests/containerd.py's (DataLoader workers, emptyDir)
containerd2=${CRIUCTL_CONTAINERD2:-/usr/local/lib/criuctl/containerd-2}
images=/usr/local/lib/criuctl/images
mode=${GUEST_MODE:-stop-and-copy}
if [ ! -x "$venv/bin/criuctl" ] || [ ! -x "$containerd2/bin/containerd" ] || [ ! -f "$images/busybox.tar" ]; then
  log "no venv at $venv, containerd 2 at $containerd2 or test image in $images (make install): no move between guests"
  echo "skipped: no venv, containerd 2 or busybox image (run make install first)" >"$move"
else
  log "the move: $pyhome and $(pwd) (with its venv) into the guests; job: $job"
  mkdir -p "$root$pyhome" "$root$(pwd)"
  cp -a "$pyhome/." "$root$pyhome/"
  tar -C "$(pwd)" --exclude=.git -cf - . | tar -C "$root$(pwd)" -xf -  # build/: the CRI stubs
  mkdir -p "$root$containerd2" "$root$images"
  cp -a "$containerd2/." "$root$containerd2/" && cp "$images/busybox.tar" "$root$images/"
  cat >"$root/root/node.sh" <<EOF2
#!/bin/bash
node=\$(sed -n 's/.*criuctl\.node=\([ab]\).*/\1/p' /proc/cmdline)
say() { echo "RESULT \$node \$1: \$2" >/dev/ttyS0; }
dev=\$(ls /sys/class/net | grep -v '^lo\$' | head -1)
ip link set lo up && ip link set "\$dev" up
ip addr add "10.250.0.\$([ "\$node" = a ] && echo 11 || echo 12)/24" dev "\$dev"
export PATH=$containerd2/bin:$venv/bin:\$PATH CRIUCTL_STATE_DIR=/var/lib/criuctl PYTHONPATH=tools:.
cd $(pwd)
pods() { python scripts/guest_pods.py "\$@" 2>>/root/pods.err | while IFS= read -r line; do say "pod_\${line%%: *}" "\${line#*: }"; done; }
pods up "\$node"
[ -s /root/pods.err ] && say pod_error "\$(tail -3 /root/pods.err | tr '\n' ' ')"
echo guest-token-for-this-run >/root/token && chmod 600 /root/token
say layout "\$(criuctl doctor 2>&1 | grep cgroups: | cut -c6-)"
criuctl agent --listen 0.0.0.0:7070 --token-file /root/token --name "\$node" --insecure \
  --runtime-endpoint unix:///var/lib/criuctl-ctr/containerd.sock --inject-dir /var/lib/criuctl-ctr/inject >/root/agent.log 2>&1 &
up() { python -c "import sys, urllib.request; urllib.request.urlopen('http://10.250.0.'+sys.argv[1]+':7070/healthz', timeout=2)" "\$1" 2>/dev/null; }
for _ in \$(seq 300); do up "\$([ "\$node" = a ] && echo 11 || echo 12)" && break; sleep 1; done
if [ "\$node" = a ]; then
  say reference "\$(python tests/workloads/$job --step-time 0 | grep '^final ')"
  for _ in \$(seq 300); do up 12 && break; sleep 1; done
  criuctl node add a http://10.250.0.11:7070 --token-file /root/token >/dev/null
  criuctl node add b http://10.250.0.12:7070 --token-file /root/token >/dev/null
  criuctl run --name job -- python tests/workloads/$job >/root/run.log 2>&1 &
  for _ in \$(seq 600); do grep -q '^step 5 ' /var/lib/criuctl/logs/job.log 2>/dev/null && break; sleep 0.5; done
  if criuctl migrate job --to b --json --mode $mode >/root/migrate.json 2>/root/migrate.err; then
    say migrate "\$(tail -1 /root/migrate.json)"
  else say migrate "failed: \$(tail -3 /root/migrate.err | tr '\n' ' ')"; say agent_log "\$(tail -5 /root/agent.log | tr '\n' ' ')"; fi
  say steps_here "\$(grep -c '^step ' /var/lib/criuctl/logs/job.log)"
  pods move $pod_steps
  [ -s /root/pods.err ] && say pod_error "\$(tail -3 /root/pods.err | tr '\n' ' ')"
  sleep infinity
else
  for _ in \$(seq 1800); do grep -q '^final ' /var/lib/criuctl/logs/job.log 2>/dev/null && break; sleep 0.5; done
  say final "\$(grep '^final ' /var/lib/criuctl/logs/job.log 2>/dev/null || echo 'none: the job did not end here')"
  say steps_here "\$(grep -c '^step ' /var/lib/criuctl/logs/job.log 2>/dev/null)"
  say first_step_here "\$(grep -m1 '^step ' /var/lib/criuctl/logs/job.log 2>/dev/null | cut -d' ' -f2)"
  [ -s /var/lib/criuctl/logs/job.log ] || say agent_log "\$(tail -5 /root/agent.log | tr '\n' ' ')"
  pods end $pod_steps
  [ -s /root/pods.err ] && say pod_error "\$(tail -3 /root/pods.err | tr '\n' ' ')"
  systemctl poweroff
fi
EOF2
  chmod +x "$root/root/node.sh"
  rm -f "$work/disk.img" && truncate -s 12G "$work/disk.img" && mkfs.ext4 -q -F -d "$root" "$work/disk.img"
  sock=$((20000 + RANDOM % 20000))
  guest() {  # NODE NETDEV: one of the two, in the background, its console in $work/NODE.log
    local accel_args=(-accel tcg,thread=multi -cpu max)
    [ "$accel" = kvm ] && accel_args=(-enable-kvm -cpu host)
    qemu-system-x86_64 "${accel_args[@]}" -m 4096 -smp 2 -nographic -no-reboot \
      -kernel "$work/vmlinuz" -initrd "$work/initrd.img" \
      -append "root=/dev/vda rw console=ttyS0 quiet criuctl.node=$1" \
      -drive "file=$work/disk.img,format=raw,if=virtio,snapshot=on" \
      -netdev "socket,id=n0,$2" -device "virtio-net-pci,netdev=n0,mac=52:54:00:00:00:1${1/a/1}" \
      >"$work/$1.log" 2>&1 &
  }
  started=$(date +%s)
  guest a "listen=127.0.0.1:$sock"; a_pid=$!
  sleep 2
  guest b "connect=127.0.0.1:$sock"; b_pid=$!
  waited=0
  while kill -0 "$b_pid" 2>/dev/null && [ "$waited" -lt "${GUEST_MOVE_SECONDS:-3600}" ]; do sleep 5; waited=$((waited + 5)); done
  kill "$a_pid" "$b_pid" 2>/dev/null || true
  wait 2>/dev/null || true
  echo "seconds: $(($(date +%s) - started))" >>"$move"
  cat "$work/a.log" "$work/b.log" | tr -d '\r' | grep -ao 'RESULT .*' | sed 's/^RESULT //' >>"$move"
  # the same job and move between two of the tests' namespace nodes on this machine (one kernel,
  # no emulator), for the numbers beside the guests'
  log "the same move between two namespace nodes on this machine"
  "$venv/bin/python" - "$job" "$mode" "$work/ns" >"$work/ns.json" 2>"$work/ns.log" <<'EOF2' ||
import json, subprocess, sys, time
from pathlib import Path
from tests.cluster import Cluster
job, mode, root = sys.argv[1].split(), sys.argv[2], Path(sys.argv[3])
# its own uninterrupted run: this CPU's kernels are not the emulated CPU's, nor are their sums
ran = subprocess.run([sys.executable, f"tests/workloads/{job[0]}", *job[1:], "--step-time", "0"],
                     capture_output=True, text=True, check=True).stdout
reference = [line.split()[1] for line in ran.splitlines() if line.startswith("final ")]
with Cluster(root, tls=False) as c:
    run = c.run("a", "job", *job)
    c.wait_step("job", 5, timeout=300)
    r = c.migrate("job", "b", "--mode", mode)
    assert r.returncode == 0, r.stderr[-2000:]
    deadline = time.monotonic() + 600
    while not c.final("job") and time.monotonic() < deadline:
        time.sleep(0.5)
    run.wait(60)
    print(json.dumps({"migrate": json.loads(r.stdout), "final": c.final("job"), "reference": reference}))
EOF2
    echo "{\"error\": \"failed: $work/ns.log\"}" >"$work/ns.json"
  log "the same container move between two namespace nodes on this machine (containerd 1.6, cgroupfs, v1)"
  PYTHONPATH=tools:. "$venv/bin/python" scripts/guest_pods.py ns "$pod_steps" >"$work/ns-pod.json" 2>"$work/ns-pod.log" ||
    echo "{\"error\": \"failed: $work/ns-pod.log\"}" >"$work/ns-pod.json"
fi

python3 - "$work/$accel.txt" "$accel" "$why_not_kvm" "$move" "$job" "$mode" "$work/ns.json" "$pod_steps" "$work/ns-pod.json" "$commit" <<'EOF'
import json, os, sys, time
path, accel, why, move_path, job, mode, ns_path, pod_steps, ns_pod_path, commit = sys.argv[1:11]
found = dict(line.split(": ", 1) for line in open(path).read().splitlines() if ": " in line)
out = {
    "commit": commit,
    "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "host_kernel": os.uname().release,
    "accelerator": accel,
    "kvm": "booted" if accel == "kvm" else why,
    "boot_and_checks_seconds": round(float(found.pop("seconds")), 1),
    "guest": {
        k: found.get(k, "not reached")
        for k in (
            "kernel", "cgroup", "pid1", "criu", "criu_check", "uffd", "dump_restore",
            "layout", "cgroupns_escape", "cgroup_root",
        )
    },
}
said = [line.split(": ", 1) for line in open(move_path).read().splitlines() if ": " in line]
every = {k.replace(" ", "_"): v for k, v in said}
move = {k: v for k, v in every.items() if "_pod_" not in k}
ref = move.get("a_reference", "").removeprefix("final ")
end = move.get("b_final", "").removeprefix("final ")
move["job"] = job
move["mode"] = mode
move["bit_identical"] = bool(ref) and ref == end
out["move_between_guests"] = move
# the container move (scripts/guest_pods.py): containerd 2, systemd cgroup driver, CDI
pod = {k.replace("_pod_", "_", 1): v for k, v in every.items() if "_pod_" in k}
ref, end = pod.get("a_reference", ""), pod.get("b_final", "")
pod["job"] = f"tests/containerd.py job_argv({pod_steps}) (train_cnn_loader.py, 2 DataLoader workers, an emptyDir)"
pod["bit_identical"] = ref.startswith("final ") and ref == end
out["container_move_between_guests"] = pod
if os.path.exists(ns_pod_path):
    ns = json.load(open(ns_pod_path))
    ns["job"] = pod["job"]
    ns["bit_identical"] = bool(ns.get("reference")) and ns.get("final") == ns["reference"]
    out["container_move_between_namespace_nodes"] = ns
if os.path.exists(ns_path):
    ns = json.load(open(ns_path))
    ns["job"], ns["mode"] = job, mode
    ns["bit_identical"] = bool(ns.get("reference")) and ns.get("final") == ns["reference"]
    out["move_between_namespace_nodes"] = ns
os.makedirs("bench/results", exist_ok=True)
with open("bench/results/guest-check.json", "w") as f:
    json.dump(out, f, indent=2)
    f.write("\n")
print(json.dumps(out, indent=2))
EOF
