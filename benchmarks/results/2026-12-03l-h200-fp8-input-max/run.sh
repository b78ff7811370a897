# fp8 input scale: the default's mse search vs the calibration max, both with GPTQ, through the Quantize node (one process per model, 16-bit runs shared)
source .gpu/pre.sh
O=/tmp/o; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
one() {  # name, args
  t=$(date +%s)
  python3 benchmarks/user_path.py $2 --runs 3 --skip-stock-file --input-scale mse --input-scale max --out $O/$1 > $O/$1.log 2>&1
  echo $1 rc=$? $(( $(date +%s)-t ))s
  grep -a "quantize node\|\"variant\"" $O/$1.log | cut -c1-330
  cp $O/$1.log $OUT/$1.log; cp $O/$1/verify_*.json $OUT/$1.json
}
one flux "--model flux"
one sdxl "--model sdxl"
