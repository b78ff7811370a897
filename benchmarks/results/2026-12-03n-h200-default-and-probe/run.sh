# the new default (fp8, max input scale + GPTQ) through the nodes with torch's caches empty, then the shared probe (its own init; it passes input_scale=mse)
source .gpu/pre.sh
O=/tmp/o; mkdir -p $O
rm -rf /tmp/torchinductor_* /tmp/ComfyUI/user/__comfy_modelopt
t=$(date +%s)
python3 benchmarks/user_path.py --model flux --runs 3 --skip-stock-file --log-info --out $O/flux_default > $O/flux_default.log 2>&1
echo flux_default rc=$? $(( $(date +%s)-t ))s
grep -a "quantize node\|frames compiled\|compiled code\|\"variant\"" $O/flux_default.log | cut -c1-330
cp $O/flux_default.log $OUT/; cp $O/flux_default/verify_*.json $OUT/flux_default.json
t=$(date +%s)
python3 .gpu/user_path_probe.py --model flux --runs 3 --gptq --out $O/probe > $O/probe.log 2>&1
echo probe rc=$? $(( $(date +%s)-t ))s
tail -12 $O/probe.log | cut -c1-330
cp $O/probe.log $OUT/; cp $O/probe/*.json $OUT/ 2>/dev/null
