#!/usr/bin/env bash
# The device runner's entry point, from the repository root on the lent machine:
#   bash benchmarks/device/run.sh OUT ENTRY [ENTRY...] [--var NAME=VALUE ...] [--set FIELD=VALUE ...]
# start.sh (the carried wheels, the NCCL settings, OUT/env.txt with the date and the tree's hash), then run.py, which
# runs the named entries of matrix.yaml (`python3 benchmarks/device/run.py --list` lists them).
. benchmarks/device/start.sh "$@"
shift
python3 benchmarks/device/run.py "$OUT" "$@"
