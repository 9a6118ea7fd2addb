# ncu profiles (full set, source-level stall samples) of the few-heads and 64-head Hopper MLA kernels,
# plus the bare warp_specialize kernel under racecheck.
set -u
REPO=$(pwd)
source scratch/site.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
(timeout -k 5 120 $SAN --tool racecheck --racecheck-report analysis --print-limit 50 python3 $REPO/exp/racecheck_warp_specialize.py > $OUT/race_ws.log 2>&1; echo "rc=$?" >> $OUT/race_ws.log)
for f in few_late16 main128 main584; do
  timeout -k 5 200 $NCU --clock-control none --set full --import-source yes --kernel-name regex:_sparse_mla_decode_hopper \
    --launch-skip 1 --launch-count 1 -f -o $SITE/$f python3 $REPO/exp/profile_ncu.py $f > $SITE/$f.run.log 2>&1
  echo "$f ncu rc=$?"; tail -3 $SITE/$f.run.log
  $NCU --import $SITE/$f.ncu-rep --page details > $OUT/$f.details.txt 2>&1
  $NCU --import $SITE/$f.ncu-rep --page source --csv --print-source sass > $SITE/$f.sass.csv 2>&1
  python3 - $SITE/$f.sass.csv $SITE/$f.sass_top.txt <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr_i = next(i for i, r in enumerate(rows) if any("Warp Stall Sampling" in c for c in r))
hdr = rows[hdr_i]; data = rows[hdr_i + 1:]
col = next(i for i, c in enumerate(hdr) if c.startswith("Warp Stall Sampling (All"))
src = next(i for i, c in enumerate(hdr) if c == "Source")
def num(x):
    try: return float(x.replace(",", ""))
    except: return 0.0
tot = sum(num(r[col]) for r in data if len(r) > col)
with open(sys.argv[2], "w") as f:
    f.write(f"columns: {hdr}\ntotal samples {tot}\n")
    for r in sorted(data, key=lambda r: -num(r[col]) if len(r) > col else 0)[:80]:
        f.write(f"{num(r[col]) / max(tot, 1) * 100:5.1f}% {r[0]} {r[src]} | " + " ".join(f"{hdr[i]}={r[i]}" for i in range(len(hdr)) if "Stall" in hdr[i] and num(r[i]) > 0.02 * num(r[col])) + "\n")
PY
  gzip -c $SITE/$f.sass.csv > $OUT/$f.sass.csv.gz
  cat $SITE/$f.sass_top.txt >> $OUT/$f.details.txt; cp $SITE/$f.sass_top.txt $SITE/top_$f.txt
done
timeout -k 5 120 python3 $REPO/exp/ab_splits.py > $OUT/ab_splits.log 2>&1; grep -v Warn $OUT/ab_splits.log | tail -5
for f in few_late16 main128 main584; do echo "== $f"; grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Issue Slots Busy|No Eligible|Active Warps Per Scheduler|Eligible Warps|Registers Per|Achieved Occupancy|One or More|Warp Cycles Per Issued" $OUT/$f.details.txt | head -20; head -25 $SITE/top_$f.txt | cut -c1-300; done
echo "== bare ws"; grep -E "correct|SUMMARY|rc=|Error" $OUT/race_ws.log | head
