source .gpu/pre.sh
tar -xJf .gpu/fa3.txz -C /tmp/site
python3 -m pytest -q tests/test_attention8.py -p no:cacheprovider 2>&1 | tail -2
python3 benchmarks/user_path.py --model flux --runs 3 --skip-stock-file --log-info --out $OUT > $OUT/up.log 2>&1; echo up rc=$?
grep -a "runtime (auto)\|\"variant\"" $OUT/up.log | cut -c1-400
tail -12 $OUT/up.log
