#!/usr/bin/env bash
# matrix.yaml ab: `bash benchmarks/device/ab_trees.sh OUT OLD_TGZ ROUNDS BENCH_ARGS...`
# (from the repository root, after start.sh). Alternates launches of the bench from the tree in OLD_TGZ (a
# `git archive | gzip` of the commit before, carried with the device tool's `carry`) and from this tree, ROUNDS
# times, the order swapped every round (old new, new old, ...; until session 8 old always ran first: an A/A check,
# run 60, found no slot bias either way, but swapping costs nothing). Appends to OUT/ab.txt (the table row of each
# launch), OUT/phases.txt and OUT/env.txt (exit codes, and a hash of this tree's sources: the device tool copies the
# working tree when the call starts, uncommitted edits included; run 57's "new" was such a tree, NOTES §23).
# AB_BENCH=gpu_ep_bench (default: 2 GPUs, one process per rank, both ranks' phase timers in phases.txt) or
# AB_BENCH=gpu_bench (one GPU, in-process ranks; pass --sections e2e; the engine's and executor's step timers,
# profile_steps, in phases.txt). AB_TIMEOUT: seconds per launch (120). With --timeline in BENCH_ARGS (trees
# before issue 30 read DATAFLOW_TIMELINE=1 instead), the launches whose tree writes timelines get their
# benchmarks/wave_timeline.py summary in OUT/timelines.txt.
set -u
OUT=$(cd "${1:?out dir}" && pwd); TGZ=${2:?old tree tarball}; ROUNDS=${3:?rounds}; shift 3
BENCH=${AB_BENCH:-gpu_ep_bench}
case $BENCH in gpu_ep_bench) MD=ep_bench.md;; gpu_bench) MD=gpu_bench.md;; *) echo "AB_BENCH: gpu_ep_bench or gpu_bench, not $BENCH"; exit 2;; esac
OLD=$(mktemp -d /tmp/old_tree.XXXX); tar -xzf "$TGZ" -C "$OLD"
# this tree copied next to the old one, so that both run from the same kind of place (fresh, no caches)
NEW=$(mktemp -d /tmp/new_tree.XXXX); tar --exclude=./.df --exclude=./.whl --exclude=./.git --exclude=./.venv -cf - . | tar -xf - -C "$NEW"
P=$(mktemp -d /tmp/ab.XXXX)
# What the new tree is, by content: the device copy's .git is stale (it named a540828 in run 63), so record a hash of
# the tracked Python sources; `bash benchmarks/device/tree_hash.sh` in a checkout gives the same hash for the same files.
echo "new tree sources: $(bash "$(dirname "$0")/tree_hash.sh")" >> "$OUT/env.txt"
for r in $(seq 1 "$ROUNDS"); do
  ORDER="old new"; [ $((r % 2)) = 0 ] && ORDER="new old"
  for v in $ORDER; do
    T=$NEW; [ $v = old ] && T=$OLD
    mkdir -p "$P/$v$r"
    STEPS=$([ $BENCH = gpu_bench ] && echo true || echo false)
    # Both spellings of the profiler's settings: a tree from before RuntimeOptions reads the DATAFLOW_PROFILE_*
    # variables, a newer one DATAFLOW_OPTIONS (runtime/settings.py); each ignores the other's.
    (cd "$T" && PYTHONPATH=/tmp/site:$T DATAFLOW_PROFILE_EXEC=$([ $STEPS = true ] && echo 1 || echo 0) \
      DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$P/$v$r/rank{rank}.prof" \
      DATAFLOW_OPTIONS="{\"profile_steps\":$STEPS,\"profile_ranks\":\"all\",\"profile_cprofile\":false,\"profile_out\":\"$P/$v$r/rank{rank}.prof\"}" \
      timeout "${AB_TIMEOUT:-120}" python3 benchmarks/$BENCH.py --out "$P/$v$r" "$@" > "$P/$v$r.log" 2>&1)
    echo "$v round $r exit $?" >> "$OUT/env.txt"
    echo "$v $r $(grep '^| streaming' "$P/$v$r/$MD" | cut -c1-200)" | tee -a "$OUT/ab.txt"
    if ls "$P/$v$r"/timeline_*.json >/dev/null 2>&1; then  # --timeline (trees that know it)
      { echo "=== $v round $r"; python3 benchmarks/wave_timeline.py "$P/$v$r"/timeline_*.json; } >> "$OUT/timelines.txt" 2>&1
    fi
    if [ $BENCH = gpu_bench ]; then
      { echo "=== $v round $r"; grep -E "attention (dispatch|execute):|executor (attention|experts|embed):|decision:" "$P/$v$r.log"; } >> "$OUT/phases.txt" 2>&1
    else
      for k in 0 1; do echo "=== $v round $r rank $k"; head -16 "$P/$v$r/rank$k.prof.phases.txt"; done >> "$OUT/phases.txt" 2>&1
    fi
  done
done
