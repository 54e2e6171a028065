#!/bin/bash
# benchmarks/kv_overlap.py with P and D in two network namespaces joined by a veth, the link
# throttled by tc tbf on P's side (not the connector's token bucket), as two hosts would be.
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
.venv/bin/python benchmarks/kv_overlap.py --p-netns $P --d-netns $D --d-host 10.77.0.2 \
  --d-bind 10.77.0.2 --tc-dev slo-veth-p --tc-netns $P "$@"
