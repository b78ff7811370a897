# GPU: a capture that fails inside (a patch syncing while captured) must leave the next capture working
# (now also tests/comfyui/test_attach.py::test_a_capture_failed_inside_leaves_the_next_captures_working, on a GPU)
import logging, sys, torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
sys.path.insert(0, "tests/comfyui")
import test_attach as T
_, sq = T.setups("sd15")
runner = T.runner_of(sq.model)
def syncing(q, k, v, extra_options):
    if torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()
    return q, k, v
m = sq.model.clone(); m.set_model_attn1_patch(syncing)
bad = sq.replace(model=m)
T.sampled(bad)
print("DIAG failed:", [v[:160] for v in runner.failed.values()], "captures", runner.captures, "releases", runner.releases, flush=True)
for name in ("batch 2", "plain"):
    case = sq if name == "plain" else T.att.apply(name, sq)
    r0 = runner.replays
    T.sampled(case); T.sampled(case)
    print("DIAG", name, "replays +", runner.replays - r0, "failed", len(runner.failed), flush=True)
