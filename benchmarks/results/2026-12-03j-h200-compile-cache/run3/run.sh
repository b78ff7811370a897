# compile cache at a first image: SDXL calibrated at 768, sampled at 1024 (compiles at its first image); torch's caches emptied before each process
source .gpu/pre.sh
O=/tmp/o; mkdir -p $O
one() {
  rm -rf /tmp/torchinductor_* ; t=$(date +%s)
  python3 benchmarks/user_path.py --model sdxl --runs 3 --skip-stock-file --log-info --calib-res 768 --res 1024 --out $O/$1 > $O/$1.log 2>&1
  echo $1 rc=$? $(( $(date +%s)-t ))s
  grep -a "compiled code\|frames compiled\|\"variant\"" $O/$1.log | cut -c1-420
  cp $O/$1.log $OUT/$1.log; cp $O/$1/verify_*.json $OUT/$1.json
  ls -la /tmp/ComfyUI/user/__comfy_modelopt/compile_cache/
}
one A_nothing_kept
one B_kept
