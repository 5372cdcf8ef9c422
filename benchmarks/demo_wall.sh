#!/usr/bin/env bash
# The embedded default's wall time and held-out accuracy on quiet cores, CPU only (issue 23):
# each `composer-replication train` runs pinned (taskset) to 2 CPUs on distinct physical cores,
# first seed 0 ALONE (the quiet wall-time figure), then seeds 0, 1, 2 side by side on disjoint
# core pairs (how much three concurrent runs cost each other). Meant for a machine with >= 6 idle
# physical cores, e.g. a device machine's host (../shared/gpu/README.md); CUDA is hidden.
#
#   bash benchmarks/demo_wall.sh            # logs, summaries and demo_wall.json under $OUT
#   SEEDS="0 1" bash benchmarks/demo_wall.sh
#
# Last line: JSON {"cpu", "torch", "alone": {seed, wall_s, load_before, heldout}, "side_by_side":
# [{seed, wall_s, heldout}, ...]}; wall_s is the whole command (start-up to exit).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/demo-wall-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SEEDS=${SEEDS:-0 1 2}
# one logical CPU per physical core, in order: pairs of them are the runs' "2 cores"
mapfile -t CPUS < <(lscpu -p=CPU,CORE,SOCKET | grep -v '^#' | sort -t, -k3,3n -k2,2n -u | cut -d, -f1)
[ ${#CPUS[@]} -ge 2 ] || mapfile -t CPUS < <(seq 0 $(($(nproc) - 1)))
one_run() {  # one_run TAG SEED CPU_A CPU_B
  local dir; dir=$(mktemp -d)
  local t0=$SECONDS
  (cd "$dir" && CUDA_VISIBLE_DEVICES="" taskset -c "$3,$4" "$PY" -m composer_replication train \
      run.name="$1" run.seed="$2" > "$OUT/$1.log" 2>&1)
  echo "$((SECONDS - t0))" > "$OUT/$1.wall"
  cp "$dir/runs/$1/summary.md" "$OUT/$1.summary.md" 2>/dev/null || true
}
cut -d' ' -f1 /proc/loadavg > "$OUT/load_before"
one_run alone_s0 0 "${CPUS[0]}" "${CPUS[1]}"
i=0
for s in $SEEDS; do
  one_run "side_s$s" "$s" "${CPUS[$((2 * i + 2))]}" "${CPUS[$((2 * i + 3))]}" &
  i=$((i + 1))
done
wait
"$PY" - "$OUT" $SEEDS <<'PY'
import json, pathlib, platform, re, sys
out = pathlib.Path(sys.argv[1])
def heldout(tag):
    text = (out / f"{tag}.log").read_text(errors="replace")
    m = re.findall(r"eval accuracy +first: \S+ +last: (\d\.\d+)", text)
    return float(m[-1]) if m else None
def wall(tag):
    p = out / f"{tag}.wall"
    return int(p.read_text()) if p.exists() else None
import torch
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
print(json.dumps({"cpu": cpu, "torch": torch.__version__,
    "alone": {"seed": 0, "wall_s": wall("alone_s0"), "load_before": (out / "load_before").read_text().strip(), "heldout": heldout("alone_s0")},
    "side_by_side": [{"seed": int(s), "wall_s": wall(f"side_s{s}"), "heldout": heldout(f"side_s{s}")} for s in sys.argv[2:]]}))
PY
