#!/usr/bin/env bash
# What the multi-node tests need from the distribution (tests/test_multinode.py, tests/test_sharded_mlp.py's mpirun
# launch): iproute2 (network namespaces), openssh-server/-client, pdsh (DeepSpeed's multi-node launcher) and
# openmpi-bin (mpirun); and for the SLURM tests (tests/test_slurm.py: tests/cluster/slurm_cluster.sh) the distribution's
# SLURM (slurmctld, slurmd, slurm-client: sbatch, srun, scontrol) and munge. Installs the missing ones with apt-get
# when run as root; anywhere else it says what would be missing and exits 0 — those tests then skip with the reason.
# Part of the README's test command. No daemon is started: the tests start their own, and stop them.
set -uo pipefail

need=()
command -v ip > /dev/null 2>&1 || need+=(iproute2)
{ command -v sshd > /dev/null 2>&1 || [ -x /usr/sbin/sshd ]; } || need+=(openssh-server)
command -v ssh > /dev/null 2>&1 || need+=(openssh-client)
command -v pdsh > /dev/null 2>&1 || need+=(pdsh)
{ command -v mpirun > /dev/null 2>&1 && command -v orted > /dev/null 2>&1; } || need+=(openmpi-bin)
command -v nsenter > /dev/null 2>&1 || need+=(util-linux)
{ command -v slurmctld > /dev/null 2>&1 || [ -x /usr/sbin/slurmctld ]; } || need+=(slurmctld)
{ command -v slurmd > /dev/null 2>&1 || [ -x /usr/sbin/slurmd ]; } || need+=(slurmd)
command -v sbatch > /dev/null 2>&1 || need+=(slurm-client)
{ command -v munged > /dev/null 2>&1 || [ -x /usr/sbin/munged ]; } || need+=(munge)

if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null 2>&1; then
    echo "note: the multi-node tests need ${need[*]} (apt-get install -y ${need[*]}, as root); they will skip" >&2
    exit 0
fi
echo "installing for the multi-node tests: ${need[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
# the packages' own services (munged, slurmctld, slurmd) must not start on this machine: the tests run their own, in
# network namespaces, and stop them; policy-rc.d's 101 tells the maintainer scripts so (where none is there yet)
policy=/usr/sbin/policy-rc.d
own_policy=""
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && own_policy=1
fi
apt-get update -qq > /dev/null && apt-get install -y -qq --no-install-recommends "${need[@]}" > /dev/null
status=$?
[ -z "$own_policy" ] || rm -f "$policy"
if [ $status -ne 0 ]; then
    echo "error: apt-get install ${need[*]} failed; the multi-node tests cannot run" >&2
    exit 1
fi
