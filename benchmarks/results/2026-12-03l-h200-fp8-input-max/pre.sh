mkdir -p /tmp/site && tar -xzf .gpu/site.tgz -C /tmp/site && tar -xzf .gpu/server.tgz -C /tmp/site && tar -xzf .gpu/comfyui.tgz -C /tmp \
  && export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH COMFYUI_PATH=/tmp/ComfyUI PYTHONUNBUFFERED=1
