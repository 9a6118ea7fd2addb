# GPU script for the few-heads kernel (branch exp/mla-small-heads): tests, A/B, sanitizers, bench.
set -u
REPO=$(pwd)
source scratch/site.sh
T=$REPO/tests
P="python3 -m pytest -q -rs -p no:cacheprovider"
L=$OUT/logs; mkdir -p $L
(timeout -k 5 300 $P -m cuda $T/test_sparse_mla.py -k "head_forms" > $L/forms.log 2>&1; echo "rc=$?" >> $L/forms.log) &
(timeout -k 5 300 $P -m cuda $T/test_sparse_mla.py -k "hopper_parity and (H1- or H16- or H20-)" > $L/par.log 2>&1; echo "rc=$?" >> $L/par.log) &
(timeout -k 5 300 $P -m cuda $T/test_sparse_mla.py -k "not hopper_parity and not head_forms" > $L/rest.log 2>&1; echo "rc=$?" >> $L/rest.log) &
cd $REPO
(OUT=$OUT/race timeout -k 5 300 bash scripts/sanitize.sh racecheck tests/test_sparse_mla.py -k "head_forms and few16 and H3" > $OUT/race.txt 2>&1; echo "rc=$?" >> $OUT/race.txt) &
(OUT=$OUT/mem timeout -k 5 300 bash scripts/sanitize.sh memcheck tests/test_sparse_mla.py -k "head_forms and few" > $OUT/mem.txt 2>&1; echo "rc=$?" >> $OUT/mem.txt) &
wait
for f in forms par rest; do echo "== $f"; grep -E "passed|failed|error|FAILED|rc=" $L/$f.log | tail -6; done
for f in race mem; do echo "== $f"; grep -E "passed|failed|SUMMARY|rc=" $OUT/$f.txt | tail -4; done
cd $SITE
timeout -k 5 200 python3 $REPO/exp/ab_few_heads.py > $OUT/ab.log 2>&1; echo "ab rc=$?"; grep -v Warn $OUT/ab.log | tail -16
