# a server's first quantized prompt across server starts: the node path makes the file, then servers
# started with torch's caches emptied (as after a reboot), one user directory (kept compiled code)
source .gpu/pre.sh   # the GPU bundle with server.tgz (main.py's own packages: sqlalchemy, ...)
O=/tmp/o; mkdir -p $O; U=/tmp/ComfyUI/user
rm -rf /tmp/torchinductor_* $U/__comfy_modelopt
t=$(date +%s)
[ -d /tmp/files ] || python3 benchmarks/user_path.py --model flux --runs 2 --skip-stock-file --log-info --keep-files /tmp/files --out $O/up > $OUT/up.log 2>&1; echo up rc=$? $(( $(date +%s)-t ))s
grep -a "\"variant\"" $OUT/up.log | cut -c1-200
for s in S1 S2 S3 S4; do
  rm -rf /tmp/torchinductor_* ; t=$(date +%s)
  python3 benchmarks/server_path.py --model flux --files /tmp/files --prompts 2 --server-arg=--user-directory=$U --out $O/$s > $OUT/$s.out 2>&1
  echo $s rc=$? $(( $(date +%s)-t ))s; grep -a "^| " $OUT/$s.out | head -8
  grep -a "Prompt executed\|compiled code\|frames compiled" $O/$s/server.log | cut -c1-250 > $OUT/$s.lines
  cp $O/$s/server_path_*.json $OUT/$s.json
done
