import sys, torch
sys.argv = [sys.argv[0], sys.argv[1], "none"]
exec(open("launch/probes/attention_bwd_dq_add.py").read())
from triton.testing import do_bench
# NaN pattern detail
for causal in (True,):
    q, k, v, do, lse, delta = make(1, 2, 2, 256, False, causal)
    do[0, 0, 10] = float("nan"); q[0, 1, 20, 3] = float("inf"); k[0, 0, 255, 7] = float("nan")
    a = bwd(q, k, v, do, lse, delta, causal, True)
    b_ = bwd(q, k, v, do, lse, delta, causal, False)
    configs.ATTN_BWD_GLUON = False
    c = bwd(q, k, v, do, lse, delta, causal, False)
    configs.ATTN_BWD_GLUON = True
    for n, x, y, z in zip("qkv", a, b_, c):
        dx = (x.isnan() != y.isnan()).nonzero().tolist()
        dz = (x.isnan() != z.isnan()).nonzero().tolist()
        say(n, "adds vs gluon pair differ at", dx[:12], len(dx), "| adds vs triton pair", dz[:12], len(dz),
            "| nan counts", x.isnan().sum().item(), y.isnan().sum().item(), z.isnan().sum().item())
for mode in (1, 2, 3):
    ABP.DIAG_MODE[0] = mode
    for name, B, H, HKV, S, views, causal in SHAPES[:3]:
        q, k, v, do, lse, delta = make(B, H, HKV, S, views, causal)
        run = ABP._launches(q, k, v, do, lse, delta, torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), 128 ** -0.5, causal, 0)
        dq = torch.zeros_like(q, dtype=torch.float32); dk = torch.empty_like(k); dv = torch.empty_like(v)
        configs.ATTN_BWD_KV_WS_DQ = True
        run = ABP._launches(q, k, v, do, lse, delta, dq, dk, dv, 128 ** -0.5, causal, 0)
        ms = do_bench(lambda: ABP._run(run, q, k, v, do, lse, delta, dq, dk, dv), warmup=25, rep=150, return_mode="median")
        configs.ATTN_BWD_KV_WS_DQ = False
        run0 = ABP._launches(q, k, v, do, lse, delta, dq, dk, dv, 128 ** -0.5, causal, 0)
        run_kv = run0._replace(q=None)
        ms0 = do_bench(lambda: ABP._run(run_kv, q, k, v, do, lse, delta, dq, dk, dv), warmup=25, rep=150, return_mode="median")
        run_q = run0._replace(kv=None)
        msq = do_bench(lambda: ABP._run(run_q, q, k, v, do, lse, delta, torch.empty_like(q), dk, dv), warmup=25, rep=150, return_mode="median")
        say("mode", mode, name, "kv+dq kernel %.3f ms" % ms, "| kv kernel alone %.3f | dq kernel alone %.3f" % (ms0, msq))
