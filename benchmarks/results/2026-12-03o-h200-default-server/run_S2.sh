# S2: right after run.sh on the same machine: rm -rf /tmp/torchinductor_*; server_path.py --model flux --files /tmp/files --prompts 3 --server-arg=--user-directory=/tmp/ComfyUI/user --out /tmp/o/S2
