set -u
REPO=$(pwd)
source scratch/site.sh
T=$REPO/tests
P="python3 -m pytest -q -rs -p no:cacheprovider"
L=$OUT/logs; mkdir -p $L
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
(timeout -k 5 300 $P -m cuda $T/test_sparse_mla.py -k "hopper_parity and fp8_656" > $L/a.log 2>&1; echo "rc=$?" >> $L/a.log) &
(timeout -k 5 300 $P -m cuda $T/test_sparse_mla.py -k "hopper_parity and fp8_584" > $L/b.log 2>&1; echo "rc=$?" >> $L/b.log) &
(timeout -k 5 300 $P -m cuda $T/test_sparse_mla.py -k "hopper_parity and not fp8_656 and not fp8_584" > $L/c.log 2>&1; echo "rc=$?" >> $L/c.log) &
(timeout -k 5 300 $P -m cuda $T/test_sparse_mla.py -k "not hopper_parity" > $L/d.log 2>&1; echo "rc=$?" >> $L/d.log) &
(timeout -k 5 120 $SAN --tool racecheck --racecheck-report analysis --print-limit 50 python3 $REPO/scratch/ws_min.py > $OUT/ws_race.log 2>&1; echo "rc=$?" >> $OUT/ws_race.log) &
cd $REPO
(OUT=$OUT/race timeout -k 5 300 bash scripts/sanitize.sh racecheck tests/test_sparse_mla.py -k "hopper_parity and T3-H20-K7" > $OUT/race.txt 2>&1; echo "rc=$?" >> $OUT/race.txt) &
(OUT=$OUT/sync timeout -k 5 300 bash scripts/sanitize.sh synccheck tests/test_sparse_mla.py -k "hopper_parity and T3-H20-K7" > $OUT/sync.txt 2>&1; echo "rc=$?" >> $OUT/sync.txt) &
wait
for f in a b c d; do echo "== $f"; grep -E "passed|failed|error|FAILED|rc=" $L/$f.log | tail -6; done
echo "== ws_min racecheck"; grep -v "^$" $OUT/ws_race.log | grep -v Warn | head -30
echo "== race"; grep -E "passed|failed|SUMMARY|rc=" $OUT/race.txt | tail -4
grep -E "Race reported|and (Write|Read) access" $OUT/race/racecheck.log | sed 's/_sparse_mla_decode_hopper_kernel+0x[0-9a-f]*//' | sort | uniq -c | sort -rn | head -20
echo "== sync"; grep -E "passed|failed|SUMMARY|rc=" $OUT/sync.txt | tail -4
cd $SITE
timeout -k 5 150 python3 $REPO/scratch/ab_named.py > $OUT/ab.log 2>&1; echo "ab rc=$?"; grep -v Warn $OUT/ab.log | tail -16
