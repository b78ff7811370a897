# SDXL: the new default alone with torch's caches and the kept code empty; Wan 2.1 1.3B 81 frames: mse search vs max input scale in one process
source .gpu/pre.sh
O=/tmp/o; mkdir -p $O
rm -rf /tmp/torchinductor_* /tmp/ComfyUI/user/__comfy_modelopt
one() {  # name, args
  t=$(date +%s)
  python3 benchmarks/user_path.py $2 --skip-stock-file --out $O/$1 > $O/$1.log 2>&1
  echo $1 rc=$? $(( $(date +%s)-t ))s
  grep -a "quantize node\|\"variant\"" $O/$1.log | cut -c1-330
  cp $O/$1.log $OUT/$1.log; cp $O/$1/verify_*.json $OUT/$1.json
}
one sdxl_default "--model sdxl --runs 3"
one wan81 "--model wan81 --runs 2 --calib-prompts 1 --input-scale mse --input-scale max"
