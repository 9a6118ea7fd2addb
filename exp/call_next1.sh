# Next GPU session, call 1 (branch exp/mla-small-heads): correctness of the few-heads kernels and the
# named-barrier hand-off, sanitizers. Prints a summary; logs under $OUT.
set -u
REPO=$(pwd)
source scratch/site.sh
T=$REPO/tests
P="python3 -m pytest -q -rs -p no:cacheprovider"
L=$OUT/logs; mkdir -p $L
# first: one small call of each new form in its own process (a hang names its kernel)
for f in few16_656 few16_656_stages few32_656 few16_584 few16_584_stages few16_auto rows64_ring_656 rows64_ring_584 named_656; do
  (cd $SITE && timeout -k 5 120 python3 $REPO/exp/smoke_new_kernels.py $f > $L/smoke_$f.log 2>&1; echo "$f rc=$?" >> $L/smoke_$f.log) &
done
wait
for f in $L/smoke_*.log; do grep -v Warn $f | tail -3; done
P="$P -o faulthandler_timeout=120"  # a test stuck in a kernel prints its traceback after 2 minutes
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
(timeout -k 5 300 $P -m cuda $T/test_sparse_mla.py -k "head_forms or raw_ring_forms" > $L/forms.log 2>&1; echo "rc=$?" >> $L/forms.log) &
(timeout -k 5 300 $P -m cuda $T/test_sparse_mla.py -k "hopper_parity and (fp8_656 or fp8_584)" > $L/par1.log 2>&1; echo "rc=$?" >> $L/par1.log) &
(timeout -k 5 300 $P -m cuda $T/test_sparse_mla.py -k "hopper_parity and not fp8_656 and not fp8_584" > $L/par2.log 2>&1; echo "rc=$?" >> $L/par2.log) &
(timeout -k 5 300 $P -m cuda $T/test_sparse_mla.py -k "not hopper_parity and not head_forms and not raw_ring_forms" > $L/rest.log 2>&1; echo "rc=$?" >> $L/rest.log) &
(cd $SITE && timeout -k 5 200 $SAN --tool racecheck --racecheck-report analysis --print-limit 100 python3 $REPO/exp/run_named_cases.py > $OUT/race_named.log 2>&1; echo "rc=$?" >> $OUT/race_named.log) &
(cd $SITE && timeout -k 5 120 $SAN --tool racecheck --racecheck-report analysis --print-limit 50 python3 $REPO/exp/racecheck_warp_specialize.py > $OUT/race_ws.log 2>&1; echo "rc=$?" >> $OUT/race_ws.log) &
cd $REPO
(OUT=$OUT/race timeout -k 5 300 bash scripts/sanitize.sh racecheck tests/test_sparse_mla.py -k "(head_forms and H3- and not rows64) or (raw_ring_forms and T3- and not stages)" > $OUT/race.txt 2>&1; echo "rc=$?" >> $OUT/race.txt) &
(OUT=$OUT/mem timeout -k 5 300 bash scripts/sanitize.sh memcheck tests/test_sparse_mla.py -k "(head_forms and not rows64) or (raw_ring_forms and not stages)" > $OUT/mem.txt 2>&1; echo "rc=$?" >> $OUT/mem.txt) &
wait
for f in forms par1 par2 rest; do echo "== $f"; grep -E "passed|failed|error|FAILED|rc=|Timeout" $L/$f.log | tail -6; done
for f in race mem; do echo "== $f"; grep -E "passed|failed|SUMMARY|rc=" $OUT/$f.txt | tail -4; done
grep -E "Race reported|and (Write|Read) access" $OUT/race/racecheck.log 2>/dev/null | sed 's/kernel+0x[0-9a-f]*//' | sort | uniq -c | sort -rn | head -12
echo "== named hand-off under racecheck"; grep -E "named ==|SUMMARY|rc=" $OUT/race_named.log | tail -10
grep -E "Race reported|and (Write|Read) access" $OUT/race_named.log | sed 's/kernel+0x[0-9a-f]*//' | sort | uniq -c | sort -rn | head -12
echo "== bare warp_specialize under racecheck"; grep -E "correct|SUMMARY|Race|access|rc=" $OUT/race_ws.log | head -12
