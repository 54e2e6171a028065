#!/bin/bash
# benchmarks/kv_overlap.py with P and D in two network namespaces joined by a veth, the link
# throttled by tc tbf (not the connector's token bucket), as two hosts would be.
# Needs root (ip netns, tc). Tears the namespaces down on exit.
#
# RAY=1: one Ray node per namespace (`ray start --head` in P's, `ray start --address` in D's,
# each pinned to its CPU) and P's and D's workers (model, KV cache, connector) as Ray actors on
# their nodes, placed by node address; the engine cores drive them as Ray drivers. This stops
# every Ray process on the host when it ends (`ray stop`).
#
#   bash benchmarks/kv_overlap_netns.sh [kv_overlap.py args, e.g. --out FILE]
#   RAY=1 bash benchmarks/kv_overlap_netns.sh [...]
set -euo pipefail
cd "$(dirname "$0")/.."
P=slo-kv-p; D=slo-kv-d
RAYX=()
cleanup() {
  if [ -n "${RAY:-}" ]; then .venv/bin/ray stop --force >/dev/null 2>&1 || true; fi
  ip netns del $P 2>/dev/null || true; ip netns del $D 2>/dev/null || true
}
trap cleanup EXIT
cleanup
ip netns add $P; ip netns add $D
ip link add slo-veth-p type veth peer name slo-veth-d
ip link set slo-veth-p netns $P; ip link set slo-veth-d netns $D
ip -n $P addr add 10.77.0.1/24 dev slo-veth-p; ip -n $D addr add 10.77.0.2/24 dev slo-veth-d
for ns in $P $D; do ip -n $ns link set lo up; done
ip -n $P link set slo-veth-p up; ip -n $D link set slo-veth-d up
# The link is shaped at D's ingress (an ifb device with tc tbf, in D's namespace) and both
# veths' receive processing runs on D's CPU (receive packet steering): with 2 CPUs, shaping on
# P's egress would run the qdisc's timer and every transmit in softirq on P's CPU, a cost a
# real NIC does not put on the prefill's cores.
ip netns exec $D sh -c 'echo 2 > /sys/class/net/slo-veth-d/queues/rx-0/rps_cpus'
ip netns exec $P sh -c 'echo 2 > /sys/class/net/slo-veth-p/queues/rx-0/rps_cpus'
ip -n $D link add slo-ifb type ifb; ip -n $D link set slo-ifb up
tc -n $D qdisc add dev slo-veth-d handle ffff: ingress
tc -n $D filter add dev slo-veth-d parent ffff: protocol ip u32 match u32 0 0 action mirred egress redirect dev slo-ifb
if [ -n "${RAY:-}" ]; then
  # every node and driver on Ray's token authentication (the token in ~/.ray/auth_token, made
  # by the head if missing), not some on it and some off as each would pick by itself
  export RAY_AUTH_MODE=token
  # Ray's own traffic (GCS, raylets) crosses the same shaped link; it is small beside the KV
  ray_node() {  # netns cpu address [ray start args]
    local ns=$1 cpu=$2 ip=$3; shift 3
    ip netns exec "$ns" taskset -c "$cpu" env OMP_NUM_THREADS=1 .venv/bin/ray start \
      --node-ip-address "$ip" --num-cpus 1 --object-store-memory 200000000 "$@" >/dev/null
  }
  ray_node $P 0 10.77.0.1 --head --port 6379 --include-dashboard false
  ray_node $D 1 10.77.0.2 --address 10.77.0.1:6379
  RAYX=(--ray-address 10.77.0.1:6379 --p-node-ip 10.77.0.1 --d-node-ip 10.77.0.2)
fi
.venv/bin/python benchmarks/kv_overlap.py "${RAYX[@]}" --p-netns $P --d-netns $D --d-host 10.77.0.2 \
  --d-bind 10.77.0.2 --tc-dev slo-ifb --tc-netns $D "$@"
