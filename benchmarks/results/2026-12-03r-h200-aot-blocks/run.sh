# H200 (torch 2.11.0+cu130, Triton 3.6, ComfyUI 0.29): five fresh processes in a row on one machine,
# after .gpu/pre.sh (the GPU bundle: ComfyUI, kitchen, torchsde, ...; see 2026-12-03j's pre.sh)
source .gpu/pre.sh
P=/tmp/aot.bin
for m in dynamo dynamo aot_save aot_load aot_load; do python3 benchmarks/results/2026-12-03r-h200-aot-blocks/aot_blocks.py $m $P 2>&1 | grep -a "RESULT\|Error\|error" | tail -3; done
