# compile cache: user path (makes the files), then servers with torch's caches wiped before each
source .gpu/pre.sh
O=/tmp/o; mkdir -p $O
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
t=$(date +%s)
python3 benchmarks/user_path.py --model flux --runs 2 --skip-stock-file --log-info --keep-files /tmp/files --out $O/up > $O/up.log 2>&1; echo up rc=$? $(( $(date +%s)-t ))s
tail -3 $O/up.log
mkdir -p /tmp/cu
server() {  # name, extra env
  rm -rf /tmp/torchinductor_* ; t=$(date +%s)
  env $2 python3 benchmarks/server_path.py --model flux --files /tmp/files --prompts 2 --server-arg=--user-directory=/tmp/cu --out $O/$1 > $O/$1.out 2>&1
  echo $1 rc=$? $(( $(date +%s)-t ))s; tail -25 $O/$1.out | grep -v "^\s*$" | tail -14
  grep -a "comfy-modelopt\].*\(compiled code\|frames compiled\)" $O/$1/server.log | cut -c1-400
  cp $O/$1/server_path.json $OUT/$1.json; cp $O/$1/server.log $OUT/$1.log
}
server S1_cold "X=1"
ls -la /tmp/cu/__comfy_modelopt/compile_cache/
server S2_bundle "X=1"
[ -n "$S3" ] && server S3_off "COMFY_MODELOPT_COMPILE_CACHE=0"
cp $O/up/*.json $OUT/ 2>/dev/null; cp $O/up.log $OUT/up.log
ls $OUT
