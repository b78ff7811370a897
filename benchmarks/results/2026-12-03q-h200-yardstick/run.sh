# the headline's yardstick column: each model's 16-bit run sampled once more in a way that should not matter
# (Flux: bf16 with PyTorch's memory-efficient SDPA instead of the kernel it picks; SDXL / Wan: the other 16-bit dtype),
# next to the nodes' default path (Calibrate -> Quantize Model -> KSampler), torch's caches as a fresh machine has them
source .gpu/pre.sh
# FA3=1: FlashAttention-3's forward for auto's FP8 attention - the fa3-fwd wheel from PyPI, xz-packed to fit the 64 MiB
# a device call carries: pip download fa3-fwd==0.0.3 --no-deps -d W; python3 -m zipfile -e W/*.whl X; tar -cJf .gpu/fa3.txz -C X .
[ -n "$FA3" ] && tar -xJf .gpu/fa3.txz -C /tmp/site && python3 -c 'import fa3_fwd_interface' && echo fa3-fwd importable
O=/tmp/o; mkdir -p $O
for m in ${MODELS:-flux sdxl}; do
  t=$(date +%s)
  python3 benchmarks/user_path.py --model $m --runs ${RUNS:-3} --skip-stock-file --yardstick $ARGS --out $O/$m > $O/$m.log 2>&1
  echo $m rc=$? $(( $(date +%s)-t ))s
  grep -a "yardstick\|quantize node" $O/$m.log | cut -c1-200; tail -6 $O/$m.log
  cp $O/$m.log $OUT/; cp $O/$m/verify_*.json $OUT/$m.json
done
