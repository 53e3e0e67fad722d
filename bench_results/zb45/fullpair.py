"""Scratch (one-off): one full backward (1F1B's) through torch.autograd.backward vs chunk_backward.backward,
paired in one process, the profile_w_lag middle chunk / --last, thread CPU per step of 8 microbatches."""
import sys, time, statistics, argparse
sys.path.insert(0, "/work/wt/zb45/scripts"); sys.path.insert(0, "/work/wt/zb45")
import torch
from profile_split_backward import _setup
from parallel3d.pipeline.chunk_backward import backward as chunk_backward
ap = argparse.ArgumentParser(); ap.add_argument("--last", action="store_true"); ap.add_argument("--rounds", type=int, default=40)
a = ap.parse_args()
args = argparse.Namespace(hidden=128, layers=8, layer_range=[6, 8] if a.last else [2, 4], last=a.last, seq=64, mbs=2, vocab=1024)
torch.set_num_threads(1)
chunk, pstate, x, grad, _ = _setup(args)
gen = torch.Generator().manual_seed(1)
xs = [x + 0.01 * torch.randn(x.shape, generator=gen) for _ in range(8)]
def step(fn):
    chunk.zero_grad(set_to_none=True); spent = 0.0
    for xx in xs:
        inp = xx.detach().clone().requires_grad_(True); out = chunk(inp)
        t0 = time.thread_time(); fn(out); del out; spent += time.thread_time() - t0
    return spent
fns = {"wrapper": lambda out: torch.autograd.backward(out, grad_tensors=grad), "chunk_backward": lambda out: chunk_backward(out, grad)}
res = {k: [] for k in fns}
for r in range(a.rounds + 2):
    got = {k: [] for k in fns}
    for k in range(4):
        name = list(fns)[(k + r) % 2]; got[name].append(step(fns[name]))
    if r >= 2:
        for k in fns: res[k].append(statistics.median(got[k]))
d = [1e6 * (c - w) for c, w in zip(res["chunk_backward"], res["wrapper"])]
q = statistics.quantiles(d, n=4)
print(f"{'last' if a.last else 'middle'} chunk, {a.rounds} rounds: wrapper {1e6*statistics.median(res['wrapper']):.0f} us/step, "
      f"chunk_backward {1e6*statistics.median(res['chunk_backward']):.0f} us/step, diff median {statistics.median(d):+.0f} [q1 {q[0]:+.0f} q3 {q[2]:+.0f}]")
