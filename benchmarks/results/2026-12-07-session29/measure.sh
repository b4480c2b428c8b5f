cd benchmarks
for i in 1 2 3; do
  for which in baseline new; do
    if [[ $which == baseline ]]; then pp=$OLDPWD/baseline_pkg; else pp=$OLDPWD; fi
    echo "== round $i: $which"
    PYTHONPATH=$pp timeout 100 python3 host_split.py --backends sm90 --calls 300 2>&1 | grep -E "^(sdpa|python|sm90|row)"
  done
done
