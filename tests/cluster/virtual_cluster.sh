#!/usr/bin/env bash
# A cluster of N "nodes" on this machine, for the multi-node tests: each node is a Linux network namespace with its
# own address on a private bridge, its own host name, and an sshd that accepts a key made for this cluster alone.
# Everything it runs is the distribution's software (iproute2, openssh-server, util-linux); the launchers that use
# it (pdsh, mpirun) are real too. Nodes share this machine's file system, as cluster nodes share NFS.
#
#   bash tests/cluster/virtual_cluster.sh check            can this machine host one? (exit 0, or 3 and the reason)
#   bash tests/cluster/virtual_cluster.sh up N DIR         start N nodes; state, keys and hostfile in DIR
#   bash tests/cluster/virtual_cluster.sh exec DIR I CMD…  run CMD on node I (its network, host name, /etc view),
#                                                          as a login there would — with this shell's environment
#   bash tests/cluster/virtual_cluster.sh down DIR         stop everything `up` started: processes, namespaces, files
#
# After `up`: DIR/hostfile names the nodes by address (`10.231.0.10 slots=2`, …; SLOTS, default 2), and inside
# every node `ssh <address or vnodeI>` logs in without a prompt (the node's /etc/ssh/ssh_config and /etc/hosts are
# its own, bind-mounted by `ip netns exec` from /etc/netns/<namespace>/). Node I is host `vnodeI` at 10.231.0.(10+I).
# The nodes' network is reachable only from the nodes: a switch namespace holds the bridge, and nothing is added to
# this machine's own network namespace. `down` is safe to repeat and after a failed `up`.
set -euo pipefail

SUBNET=10.231.0
die() { echo "virtual_cluster: $*" >&2; exit 2; }

prefix_of() {  # namespace and interface names for DIR: short (interface names have 15 characters at most)
    echo "dsr$(printf '%s' "$(realpath -m "$1")" | sha1sum | cut -c1-6)"
}

check() {
    [ "$(id -u)" = 0 ] || { echo "needs root (network namespaces, sshd)"; return 3; }
    local tool
    for tool in ip unshare nsenter sshd ssh ssh-keygen; do
        command -v "$tool" > /dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || {
            echo "needs $tool (apt-get install -y iproute2 openssh-server openssh-client util-linux)"; return 3; }
    done
    local probe="dsrprobe$$"
    if ! ip netns add "$probe" 2> /dev/null; then
        echo "cannot create network namespaces here (ip netns add failed: a container without CAP_SYS_ADMIN?)"
        return 3
    fi
    ip netns del "$probe"
}

up() {
    local n="$1" dir="$2" slots="${SLOTS:-2}"
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 16 ] || die "N must be 1..16, got '$n'"
    check > /dev/null || die "$(check)"
    mkdir -p "$dir"
    dir=$(realpath "$dir")
    [ ! -e "$dir/cluster.env" ] || die "$dir already holds a cluster; run: $0 down $dir"
    local p sshd
    p=$(prefix_of "$dir")
    sshd=$(command -v sshd || echo /usr/sbin/sshd)
    echo "PREFIX=$p" > "$dir/cluster.env"
    echo "NODES=$n" >> "$dir/cluster.env"
    mkdir -p "$dir/keys" /run/sshd
    ssh-keygen -q -t ed25519 -N '' -C "virtual-cluster" -f "$dir/keys/id_ed25519"
    ssh-keygen -q -t ed25519 -N '' -C "virtual-cluster-host" -f "$dir/keys/host_ed25519"
    cp "$dir/keys/id_ed25519.pub" "$dir/keys/authorized_keys"
    chmod 600 "$dir/keys/"*

    ip netns add "$p-sw"
    ip -n "$p-sw" link add br0 type bridge
    ip -n "$p-sw" link set br0 up
    ip -n "$p-sw" link set lo up
    : > "$dir/hostfile"
    local hosts="127.0.0.1 localhost"
    local i
    for i in $(seq 0 $((n - 1))); do hosts+=$'\n'"$SUBNET.$((10 + i)) vnode$i"; done
    for i in $(seq 0 $((n - 1))); do
        local ns="$p-n$i" addr="$SUBNET.$((10 + i))" node="$dir/node$i"
        mkdir -p "$node"
        ip netns add "$ns"
        # a veth pair: one end on the switch's bridge, the other the node's eth0
        ip link add "${p}a$i" type veth peer name "${p}b$i"
        ip link set "${p}a$i" netns "$p-sw"
        ip link set "${p}b$i" netns "$ns"
        ip -n "$p-sw" link set "${p}a$i" master br0 up
        ip -n "$ns" link set "${p}b$i" name eth0
        ip -n "$ns" addr add "$addr/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        # the node's own /etc/hosts and ssh client configuration (ip netns exec bind-mounts /etc/netns/NS/*)
        mkdir -p "/etc/netns/$ns/ssh"
        printf '%s\n' "$hosts" > "/etc/netns/$ns/hosts"
        cp -a /etc/ssh/. "/etc/netns/$ns/ssh/" 2> /dev/null || true
        cat > "/etc/netns/$ns/ssh/ssh_config" <<CONF
Host *
    User root
    IdentityFile $dir/keys/id_ed25519
    IdentitiesOnly yes
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    GlobalKnownHostsFile /dev/null
    BatchMode yes
    ConnectTimeout 10
    LogLevel ERROR
CONF
        cat > "$node/sshd_config" <<CONF
ListenAddress $addr
Port 22
HostKey $dir/keys/host_ed25519
AuthorizedKeysFile $dir/keys/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile $node/sshd.pid
MaxStartups 64
MaxSessions 64
PrintMotd no
X11Forwarding no
LogLevel ERROR
CONF
        # its own host name (a UTS namespace), so a process there resolves its name to its own address, as gloo does
        ip netns exec "$ns" unshare --uts sh -c "hostname vnode$i && exec $sshd -f $node/sshd_config -E $node/sshd.log"
        local t
        for t in $(seq 1 50); do [ -s "$node/sshd.pid" ] && break; sleep 0.1; done
        [ -s "$node/sshd.pid" ] || die "sshd on node $i did not start: $(cat "$node/sshd.log" 2> /dev/null)"
        echo "$addr slots=$slots" >> "$dir/hostfile"
        {
            echo "NODE${i}_NS=$ns"
            echo "NODE${i}_ADDR=$addr"
            echo "NODE${i}_SSHD=$(cat "$node/sshd.pid")"
        } >> "$dir/cluster.env"
    done
    # every node can log in to every node (what pdsh and mpirun need); wait until each sshd answers
    for i in $(seq 0 $((n - 1))); do
        local ok=""
        for t in $(seq 1 50); do
            if run_on "$dir" 0 ssh "$SUBNET.$((10 + i))" true 2> /dev/null; then ok=1; break; fi
            sleep 0.2
        done
        [ -n "$ok" ] || die "node 0 cannot ssh to node $i"
    done
}

run_on() {  # DIR I CMD…: enter node I's namespaces (those of its sshd: network, mount, host name)
    local dir="$1" i="$2"
    shift 2
    # shellcheck disable=SC1091
    source "$dir/cluster.env"
    local var="NODE${i}_SSHD"
    [ -n "${!var:-}" ] || die "no node $i in $dir"
    nsenter --target "${!var}" --net --mount --uts --wd="$PWD" -- "$@"
}

down() {
    local dir="$1"
    [ -d "$dir" ] || return 0
    dir=$(realpath "$dir")
    local p
    p=$(prefix_of "$dir")
    # every process in a node's network namespace (sshd, sessions, launchers, ranks): its namespace dies with it
    local ns pids round
    for round in 1 2 3; do
        for ns in $(ip netns list 2> /dev/null | awk '{print $1}' | grep "^$p-" || true); do
            pids=$(ip netns pids "$ns" 2> /dev/null || true)
            [ -z "$pids" ] || kill -9 $pids 2> /dev/null || true
        done
        sleep 0.2
    done
    for ns in $(ip netns list 2> /dev/null | awk '{print $1}' | grep "^$p-" || true); do
        ip netns del "$ns" 2> /dev/null || true
        rm -rf "/etc/netns/$ns"
    done
    rm -f "$dir/cluster.env"
}

case "${1:-}" in
    check) check ;;
    up) [ $# -eq 3 ] || die "usage: $0 up N DIR"; up "$2" "$3" ;;
    exec) [ $# -ge 4 ] || die "usage: $0 exec DIR I CMD..."; d="$2"; i="$3"; shift 3; run_on "$d" "$i" "$@" ;;
    down) [ $# -eq 2 ] || die "usage: $0 down DIR"; down "$2" ;;
    -h|--help|"") sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; [ -n "${1:-}" ] ;;
    *) die "unknown command '$1' (check, up, exec, down)" ;;
esac
