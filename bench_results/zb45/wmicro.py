"""Scratch (one-off): W's 8 closures of a hidden-128 middle chunk, cold (64 MiB written between),
mm-then-add (now) vs mm(out=scratch)-then-add; bitwise check; thread CPU per W."""
import time, statistics, torch, sys
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
R, H, F = 128, 128, 512
shapes = [(H, 3*H, True), (H, H, False), (H, F, True), (F, H, False)] * 2  # (in, out, bias)
data = [(torch.randn(R, i, generator=g), torch.randn(R, o, generator=g), torch.randn(o, i, generator=g),
         torch.randn(o, generator=g) if b else None) for i, o, b in shapes]
junk = torch.empty(16 * 1024 * 1024)
cold = "--hot" not in sys.argv
def w_now():
    for x, gr, pg, pb in data:
        wg = gr.t().mm(x); pg += wg
        if pb is not None:
            pb += gr.sum(0)
def w_out(buf):
    for x, gr, pg, pb in data:
        o = buf[: pg.numel()].view(pg.shape)
        torch.mm(gr.t(), x, out=o); pg += o
        if pb is not None:
            pb += gr.sum(0)
# bitwise
for x, gr, pg, pb in data:
    a = gr.t().mm(x); b = torch.empty_like(a); torch.mm(gr.t(), x, out=b)
    assert torch.equal(a, b)
buf = torch.empty(max(p.numel() for _, _, p, _ in data))
t = {"now": [], "out": []}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 200):
    for name in (("now", "out") if r % 2 else ("out", "now")):
        if cold:
            junk.fill_(r)
        t0 = time.thread_time()
        w_now() if name == "now" else w_out(buf)
        t[name].append(time.thread_time() - t0)
for k, v in t.items():
    print(k, f"{1e6*statistics.median(v):.0f} us  q1 {1e6*statistics.quantiles(v,n=4)[0]:.0f} q3 {1e6*statistics.quantiles(v,n=4)[2]:.0f}")
d = [a - b for a, b in zip(t["out"], t["now"])]
print("out - now median", f"{1e6*statistics.median(d):+.1f} us", "q", [f"{1e6*q:+.1f}" for q in statistics.quantiles(d, n=4)])
