# Next GPU session, call 2 (branch exp/mla-small-heads): timings. The few-heads forms against the 64-head
# kernel, the named hand-off against the mbarrier one, then the benchmark's MLA rows.
set -u
REPO=$(pwd)
source scratch/site.sh
timeout -k 5 240 python3 $REPO/exp/ab_few_heads.py > $OUT/ab_few.log 2>&1; echo "ab_few rc=$?"; grep -v Warn $OUT/ab_few.log | tail -16
timeout -k 5 150 python3 $REPO/exp/ab_named_handoff.py > $OUT/ab_named.log 2>&1; echo "ab_named rc=$?"; grep -v Warn $OUT/ab_named.log | tail -14
timeout -k 5 180 python3 -m torch_sparse_mla.bench mla --out $OUT/bench_mla.md > $OUT/bench.log 2>&1; echo "bench rc=$?"; grep "^|" $OUT/bench_mla.md | head -30
