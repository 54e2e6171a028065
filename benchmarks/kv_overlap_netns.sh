#!/bin/bash
# benchmarks/kv_overlap.py with P and D in two network namespaces joined by a veth, the link
# throttled by tc tbf (not the connector's token bucket), as two hosts would be.
# Needs root (ip netns, tc). Tears the namespaces down on exit.
#
#   bash benchmarks/kv_overlap_netns.sh [kv_overlap.py args, e.g. --out FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
P=slo-kv-p; D=slo-kv-d
cleanup() { ip netns del $P 2>/dev/null || true; ip netns del $D 2>/dev/null || true; }
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
.venv/bin/python benchmarks/kv_overlap.py --p-netns $P --d-netns $D --d-host 10.77.0.2 \
  --d-bind 10.77.0.2 --tc-dev slo-ifb --tc-netns $D "$@"
