# the new default (fp8 max input scale + GPTQ): node path makes the file, then a ComfyUI server over HTTP after a 'reboot' (torch caches emptied), one user directory
source .gpu/pre.sh
O=/tmp/o; mkdir -p $O; U=/tmp/ComfyUI/user
rm -rf /tmp/torchinductor_* $U/__comfy_modelopt
t=$(date +%s)
python3 benchmarks/user_path.py --model flux --runs 2 --skip-stock-file --log-info --keep-files /tmp/files --out $O/up > $O/up.log 2>&1; echo up rc=$? $(( $(date +%s)-t ))s
grep -a "quantize node\|\"variant\"" $O/up.log | cut -c1-300
cp $O/up.log $OUT/up.log; cp $O/up/verify_*.json $OUT/up.json
rm -rf /tmp/torchinductor_* ; t=$(date +%s)
python3 benchmarks/server_path.py --model flux --files /tmp/files --prompts 3 --server-arg=--user-directory=$U --out $O/S1 > $O/S1.out 2>&1
echo S1 rc=$? $(( $(date +%s)-t ))s; grep -a "^| \|final latent\|WARNING/ERROR" $O/S1.out
grep -a "comfy-modelopt\].*\(compiled code\|frames compiled\)" $O/S1/server.log | cut -c1-330
cp $O/S1/server_path_*.json $OUT/S1.json; cp $O/S1/server.log $OUT/S1.log; cp $O/S1.out $OUT/S1.out
