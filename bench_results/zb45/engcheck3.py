import time, statistics, torch
from torch.autograd import Variable
from torch.autograd.graph import _engine_run_backward as erb
torch.set_num_threads(1)
ps = [torch.nn.Parameter(torch.randn(4)) for _ in range(12)]
def graph():
    x = torch.randn(2, 4, requires_grad=True)
    y = x
    for p in ps:
        y = y * p
    return x, y
eng = Variable._execution_engine.run_backward
modes = ["api_in", "erb_in", "eng_in"]
t = {m: [] for m in modes}
for r in range(4000):
    for k in range(3):
        name = modes[(k + r) % 3]
        x, out = graph(); g = torch.ones(2, 4)
        t0 = time.thread_time_ns()
        if name == "api_in":
            torch.autograd.backward(out, grad_tensors=g, inputs=[x, *ps])
        elif name == "erb_in":
            erb((out,), (g,), False, False, (x, *ps), allow_unreachable=True, accumulate_grad=True)
        else:
            eng((out,), (g,), False, False, (x, *ps), allow_unreachable=True, accumulate_grad=True)
        t[name].append(time.thread_time_ns() - t0)
for k, v in t.items():
    print(k, statistics.median(v) / 1e3, "us")
