"""Scratch: is bmm over two stacked layers bitwise the two mm's? (W GEMM batching across layers)"""
import torch
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
for R, i, o in [(128,128,384),(128,128,128),(128,128,512),(128,512,128),(256,128,384),(1024,256,768)]:
    xs = torch.randn(2, R, i, generator=g); gs = torch.randn(2, R, o, generator=g)
    b = torch.bmm(gs.transpose(1, 2), xs)
    m = torch.stack([gs[k].t().mm(xs[k]) for k in range(2)])
    pg = torch.randn(2, o, i, generator=g)
    ref = pg.clone(); ref += m
    bad = torch.baddbmm(pg, gs.transpose(1, 2), xs)
    print(R, i, o, "bmm==mm", torch.equal(b, m), "baddbmm==mm+add", torch.equal(bad, ref), f"{(b-m).abs().max().item():.2e}")
