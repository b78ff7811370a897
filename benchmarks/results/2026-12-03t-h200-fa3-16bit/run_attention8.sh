source .gpu/pre.sh
tar -xJf .gpu/fa3.txz -C /tmp/site
python3 benchmarks/attention8.py --out $OUT --shapes "Wan 2.1 1.3B 832x480, 81 frames" "Wan 2.1 1.3B 832x480, 81 frames, cfg batch 2" "Wan 2.1 14B 832x480, 33 frames, cfg batch 2" "Flux.1-dev 2048x2048" "Flux.1-dev 1024x1024 (4,096 image + 512 text tokens)" 2>&1 | grep -v "^W1203" | tail -12
