import os, time, datetime, timeit, sys
sys.path.insert(0, "scripts")
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29671")
dist.init_process_group("gloo", rank=0, world_size=1)
from parallel3d.parallel_state import ParallelState
from parallel3d.topology import Topology
from bench_pipeline_group import _build_chunks
from parallel3d.pipeline.tied import tied_embedding_params
from parallel3d.deferred_grads import backward_inputs
class A: layers=8; hidden=128; vocab=1024; seq=64
pstate = ParallelState(Topology(tp=1, pp=1, dp=1))
chunks = _build_chunks(A, pstate, 1)
n = 2000
print("params", sum(1 for c in chunks for _ in c.parameters()))
print("tied_embedding_params us", 1e6*timeit.timeit(lambda: tied_embedding_params(chunks), number=n)/n)
print("backward_inputs us", 1e6*timeit.timeit(lambda: [backward_inputs(c.parameters()) for c in chunks], number=n)/n)
ps = [list(c.parameters()) for c in chunks]
print("list params us", 1e6*timeit.timeit(lambda: [list(c.parameters()) for c in chunks], number=n)/n)
print("backward_inputs cached list us", 1e6*timeit.timeit(lambda: [backward_inputs(p) for p in ps], number=n)/n)
from parallel3d.param_meta import is_wgrad_deferrable
print("n deferrable", sum(is_wgrad_deferrable(p) for p in ps[0]), len(ps[0]))
