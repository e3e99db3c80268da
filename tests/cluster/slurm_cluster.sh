#!/usr/bin/env bash
# A SLURM cluster of N "nodes" on this machine, for the SLURM tests (tests/test_slurm.py): the network-namespace nodes
# of virtual_cluster.sh, and on them the distribution's SLURM — one munged, slurmctld on node 0 (the head node, which
# also computes) and one slurmd per node, each seeing its own host name, so srun places tasks on nodes as on a real
# cluster. Nothing is faked: sbatch, srun, scontrol, requeue and signals are SLURM's own.
#
#   bash tests/cluster/slurm_cluster.sh check            can this machine host one? (exit 0, or 3 and the reason)
#   bash tests/cluster/slurm_cluster.sh up N DIR         start N nodes (CPUS each, default 2); everything in DIR
#   bash tests/cluster/slurm_cluster.sh exec DIR I CMD…  run CMD on node I as a user logged in there (SLURM_CONF set)
#   bash tests/cluster/slurm_cluster.sh down DIR         stop every daemon, job and namespace `up` started
#
# DIR/slurm.conf is the cluster's configuration (the client commands read it through SLURM_CONF, which `exec` sets).
# Settings a test relies on: AuthInfo cred_expire=10 (SLURM holds a requeued job back for its credential lifetime,
# 120 s by default: a requeued job waited ~170 s; with 10 s it restarts ~24 s later), KillWait=30 (TERM → KILL at a
# time limit or scancel, SLURM's default), SlurmdTimeout=20 (a node whose slurmd is gone is down after that),
# SlurmdParameters=config_overrides (each node claims CPUS cores of the 2 this machine may have), sched_interval=2
# (a requeued job whose hold has passed starts at the next scheduling pass: 60 s apart by default).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VC="$HERE/virtual_cluster.sh"
die() { echo "slurm_cluster: $*" >&2; exit 2; }

sbin() {  # NAME: a daemon's path (Debian puts them in /usr/sbin, which a user's PATH may lack)
    command -v "$1" 2> /dev/null || { [ -x "/usr/sbin/$1" ] && echo "/usr/sbin/$1"; } || return 1
}

check() {
    bash "$VC" check || return $?
    local tool
    for tool in munged slurmctld slurmd sbatch srun scontrol squeue; do
        sbin "$tool" > /dev/null || {
            echo "needs $tool (apt-get install -y slurmctld slurmd slurm-client munge: tests/cluster/install_packages.sh)"
            return 3
        }
    done
}

write_conf() {  # DIR N CPUS
    local dir="$1" n="$2" cpus="$3" i
    cat > "$dir/slurm.conf" <<CONF
ClusterName=dsrvirtual
SlurmctldHost=vnode0($(addr 0))
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/spool/%n/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
SlurmdTimeout=20
SlurmctldTimeout=30
InactiveLimit=0
KillWait=30
MinJobAge=600
SlurmdParameters=config_overrides
CONF
    for i in $(seq 0 $((n - 1))); do
        echo "NodeName=vnode$i NodeAddr=$(addr "$i") CPUs=$cpus RealMemory=4000 State=UNKNOWN" >> "$dir/slurm.conf"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >> "$dir/slurm.conf"
}

addr() { echo "10.231.0.$((10 + $1))"; }       # virtual_cluster.sh's addresses

mount_cgroups() {  # DIR I: slurmd will not start without the cgroup file system, which a node's own /sys lacks (ip
    # netns exec mounts a fresh sysfs): mount this machine's hierarchies again inside node I's mount namespace only
    local dir="$1" i="$2"
    if [ "$(stat -f -c %T /sys/fs/cgroup 2> /dev/null)" = cgroup2fs ]; then
        on_node "$dir" "$i" mount -t cgroup2 none /sys/fs/cgroup
        return
    fi
    # cgroup v1: a tmpfs with one mount per controller this machine has mounted
    local controllers
    controllers=$(awk '$3 == "cgroup" {print $2}' /proc/mounts | xargs -r -n1 basename | grep -vx systemd | sort -u)
    on_node "$dir" "$i" sh -c 'mount -t tmpfs cgroup_root /sys/fs/cgroup && for c in "$@"; do
        mkdir -p "/sys/fs/cgroup/$c" && mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c" || exit 1; done' sh $controllers
}

on_node() {  # DIR I CMD…
    local dir="$1" i="$2"
    shift 2
    SLURM_CONF="$dir/slurm.conf" bash "$VC" exec "$dir" "$i" "$@"
}

up() {
    local n="$1" dir="$2" cpus="${CPUS:-2}" i t
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 8 ] || die "N must be 1..8, got '$n'"
    check > /dev/null || die "$(check)"
    mkdir -p "$dir"
    dir=$(realpath "$dir")
    [[ "$dir" =~ ^[A-Za-z0-9_./-]+$ ]] || die "DIR must be a plain path (slurm.conf cannot quote): $dir"
    SLOTS="$cpus" bash "$VC" up "$n" "$dir"
    mkdir -p "$dir/munge" "$dir/state" "$dir/log"
    for i in $(seq 0 $((n - 1))); do mkdir -p "$dir/spool/vnode$i"; done
    chmod 755 "$dir/munge"                      # munged: clients need to reach its socket
    head -c 1024 /dev/urandom > "$dir/munge/munge.key"
    chmod 400 "$dir/munge/munge.key"
    write_conf "$dir" "$n" "$cpus"
    # no cgroup confinement (proctrack/linuxproc, task/none), but slurmd loads the plugin: the version this machine runs
    if [ "$(stat -f -c %T /sys/fs/cgroup 2> /dev/null)" = cgroup2fs ]; then
        printf 'CgroupPlugin=cgroup/v2\nIgnoreSystemd=yes\n' > "$dir/cgroup.conf"
    else
        printf 'CgroupPlugin=cgroup/v1\n' > "$dir/cgroup.conf"
    fi
    # one munged for every node: its socket is a file, which every namespace sees (nodes share the file system)
    on_node "$dir" 0 "$(sbin munged)" --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
    for t in $(seq 1 50); do [ -S "$dir/munge/munge.socket" ] && break; sleep 0.1; done
    [ -S "$dir/munge/munge.socket" ] || die "munged did not start: $(cat "$dir/log/munged.log" 2> /dev/null)"
    on_node "$dir" 0 "$(sbin slurmctld)" -f "$dir/slurm.conf"
    for i in $(seq 0 $((n - 1))); do
        mount_cgroups "$dir" "$i" || die "cannot mount the cgroup file system on node $i"
        on_node "$dir" "$i" "$(sbin slurmd)" -f "$dir/slurm.conf"
    done
    # ready when every node is idle (slurmd registered with slurmctld)
    local idle=""
    for t in $(seq 1 150); do
        idle=$(on_node "$dir" 0 sinfo -h -N -o '%N %t' 2> /dev/null | awk '$2 == "idle"' | wc -l || true)
        [ "$idle" = "$n" ] && break
        sleep 0.2
    done
    [ "$idle" = "$n" ] || die "the nodes did not come up ($idle of $n idle): $(on_node "$dir" 0 sinfo -N 2>&1 || true)
$(tail -n 20 "$dir/log/slurmctld.log" 2> /dev/null)"
}

down() {
    local dir="$1"
    [ -d "$dir" ] || return 0
    # every daemon, job step and rank runs in a node's network namespace: virtual_cluster.sh kills them all and
    # removes the namespaces
    bash "$VC" down "$dir"
}

case "${1:-}" in
    check) check ;;
    up) [ $# -eq 3 ] || die "usage: $0 up N DIR"; up "$2" "$3" ;;
    exec) [ $# -ge 4 ] || die "usage: $0 exec DIR I CMD..."; d=$(realpath "$2"); i="$3"; shift 3; on_node "$d" "$i" "$@" ;;
    down) [ $# -eq 2 ] || die "usage: $0 down DIR"; down "$2" ;;
    -h|--help|"") sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; [ -n "${1:-}" ] ;;
    *) die "unknown command '$1' (check, up, exec, down)" ;;
esac
