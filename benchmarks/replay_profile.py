import cProfile, pstats, time, torch
from vsa_torch import video_sparse_attn
from vsa_torch import ops as O
from vsa_core.replay import Replay
B,H,S,D,E,topk = 1,2,4096,128,64,16
g = torch.Generator("cuda").manual_seed(0)
q,k,v,gt = (torch.randn(B,H,S,D,device="cuda",dtype=torch.bfloat16,generator=g).requires_grad_() for _ in range(4))
c = torch.full((S//E,),E,device="cuda",dtype=torch.int32)
for _ in range(5): video_sparse_attn(q,k,v,c,c,topk,E,gt,backend="triton")
fw = [e for kk,e in O._REPLAYS.items() if isinstance(e,Replay) and kk[0]=="forward"][0]
print("steps", [s.name for s in fw.steps], "descs", [len(s.descriptors) for s in fw.steps])
cap = {}
orig = Replay.run
def grab(self, buffers, stream): cap["b"]=buffers; return orig(self, buffers, stream)
Replay.run = grab
video_sparse_attn(q,k,v,c,c,topk,E,gt,backend="triton")
Replay.run = orig
b = cap["b"]; st = torch.cuda.current_stream().cuda_stream
def t(fn, n=300):
    fn(); torch.cuda.synchronize(); t0=time.perf_counter()
    for _ in range(n): fn()
    t1=time.perf_counter(); torch.cuda.synchronize(); return (t1-t0)*1e6/n
print("replay.run us", t(lambda: fw.run(b, st)))
for s in fw.steps:
    addr = {n: b[n].data_ptr() for n in fw.buffers}
    print(" step", s.name, "us", t(lambda: s.launch(addr, st)))
pr = cProfile.Profile(); pr.enable()
for _ in range(300): fw.run(b, st)
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(12)
with torch.no_grad(): print("no_grad public fwd us", t(lambda: video_sparse_attn(q,k,v,c,c,topk,E,gt,backend="triton")))
print("train public fwd us", t(lambda: video_sparse_attn(q,k,v,c,c,topk,E,gt,backend="triton")))
pr = cProfile.Profile(); pr.enable()
for _ in range(300): video_sparse_attn(q,k,v,c,c,topk,E,gt,backend="triton")
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(25)
