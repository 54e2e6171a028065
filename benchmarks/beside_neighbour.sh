#!/usr/bin/env bash
# Run a command beside a CPU-bound neighbour pinned to one core (issue 33's "busy neighbour"):
#   bash benchmarks/beside_neighbour.sh bash ../shared/compare/compare.sh --sloserve-checkout .
#   bash benchmarks/beside_neighbour.sh make demo
# The neighbour is `taskset -c $NEIGHBOUR_CPU sh -c 'while :; do :; done'` (default CPU 1) at this
# shell's priority, in a session of its own; it is killed when the command ends or is interrupted.
# The command's exit status is this script's.
set -euo pipefail
if [ $# -eq 0 ]; then
  echo "usage: beside_neighbour.sh COMMAND [ARGS...]" >&2
  exit 2
fi
cpu="${NEIGHBOUR_CPU:-1}"
setsid taskset -c "$cpu" sh -c 'while :; do :; done' &
neighbour=$!
trap 'kill "$neighbour" 2>/dev/null || true' EXIT INT TERM
echo "beside_neighbour: busy loop pid $neighbour on CPU $cpu" >&2
"$@"
