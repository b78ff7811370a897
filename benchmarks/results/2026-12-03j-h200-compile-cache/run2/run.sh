# compile cache, one user directory for the node path and the servers (as one ComfyUI install has)
source .gpu/pre.sh
O=/tmp/o; mkdir -p $O; U=/tmp/ComfyUI/user
t=$(date +%s)
python3 benchmarks/user_path.py --model flux --runs 2 --skip-stock-file --log-info --keep-files /tmp/files --out $O/up > $O/up.log 2>&1; echo up rc=$? $(( $(date +%s)-t ))s
grep -a "compiled code\|frames compiled" $O/up.log | cut -c1-300; ls -la $U/__comfy_modelopt/compile_cache/
server() {
  rm -rf /tmp/torchinductor_* ; t=$(date +%s)
  python3 benchmarks/server_path.py --model flux --files /tmp/files --prompts 2 --server-arg=--user-directory=$U --out $O/$1 > $O/$1.out 2>&1
  echo $1 rc=$? $(( $(date +%s)-t ))s; grep -a "^| \|final latent\|WARNING/ERROR" $O/$1.out
  grep -a "comfy-modelopt\].*\(compiled code\|frames compiled\)" $O/$1/server.log | cut -c1-330
  cp $O/$1/server_path_*.json $OUT/$1.json; cp $O/$1/server.log $OUT/$1.log; ls -la $U/__comfy_modelopt/compile_cache/
}
server S1_after_node
server S2_after_both
cp $O/up.log $OUT/up.log
