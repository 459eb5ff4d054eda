"""Rows of ``bench attention`` for the attention variants and the layouts real models use.

- Variants at S = 32k, B = 1, H = 16, D = 128, bf16, forward and forward+backward: plain causal,
  causal with 16 documents of 2k, causal with a window of 4096, causal with softcap 50, causal
  with sinks. splitsoftmax beside
  FlexAttention compiled with ``torch.compile`` and, where SDPA can express the variant, SDPA
  cuDNN (the 16 documents as a batch of 16 causal sequences). TFLOP/s count ``4 * H * D`` per
  visible (query, key) pair (3.5 times that forward+backward).
- GQA 32/8 and 16/4 at batch 1, causal, S = 8k and 32k: q, k, v contiguous ``(B, H, S, D)`` and as
  ``(B, H, S, D)`` views of ``(B, S, H, D)`` tensors, the way Hugging Face passes them (the output
  then made ``(B, S, H, Dv)`` contiguous, as the model does next), beside SDPA cuDNN and flash;
  ``ss_kernel`` is the local op alone (``ops.attention.fwd.attn_fwd``), without the custom op.

Every row is checked: on 64 sampled query rows the error against float64 must be at most 2x Flex's
(variants; where Flex does not run, 2x that of torch's bf16 attention of those rows) or cuDNN's
(layouts).
"""
from __future__ import annotations

import inspect
import json
import sys

import torch
import torch.nn.functional as F

import splitsoftmax as ss
from splitsoftmax.ops.attention import fwd as A
from splitsoftmax.core.mask import Mask

from . import best_ms

S, H, D = 32768, 16, 128
DOCS, WINDOW, SOFTCAP = 16, 4096, 50.0
VARIANTS = ["causal", "documents", "window", "softcap", "sinks"]
GQA = [(32, 8), (16, 4)]
GQA_SEQS = [8192, 32768]


def _bounds(name: str, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[lo, hi)`` that query ``rows`` see under variant ``name`` (all causal)."""
    lo = torch.zeros_like(rows)
    if name == "documents":
        lo = rows - rows % (S // DOCS)
    elif name == "window":
        lo = (rows - (WINDOW - 1)).clamp_min(0)
    return lo, rows + 1


def visible_pairs(name: str, s: int = S) -> int:
    rows = torch.arange(s)
    lo, hi = _bounds(name, rows)
    return int((hi - lo).sum())


def _public() -> bool:
    """Whether ``ss.attention`` takes every variant keyword (else the rows call the local op)."""
    return all(n in inspect.signature(ss.attention).parameters for n in ("cu_seqlens", "window_size", "softcap",
                                                                          "sinks"))


def ss_fn(name: str, sinks: torch.Tensor):
    """splitsoftmax's call for variant ``name``: the public ``ss.attention`` where it takes the
    variant keywords, else the local op (``ops.attention.fwd.attn_fwd`` with the mask; sinks as the
    initial partial state that the kernel merges into). Returns ``(fn, via)``."""
    kw = {"documents": dict(cu_seqlens=list(range(0, S + 1, S // DOCS))), "window": dict(window_size=(WINDOW - 1, 0)),
          "softcap": dict(softcap=SOFTCAP), "sinks": dict(sinks=sinks), "causal": {}}[name]
    if _public():
        return (lambda q, k, v: ss.attention(q, k, v, causal=True, **kw)), "ss.attention"
    scale = D ** -0.5
    if name == "sinks":
        def run(q, k, v):
            out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            lse = sinks.float().view(1, -1, 1).expand(q.shape[:3]).contiguous()
            A.attn_fwd_acc(q, k, v, scale, True, 0, out, lse)
            return out.to(q.dtype)
        return run, "attn_fwd_acc from the sink state"
    rows = torch.arange(S, dtype=torch.int32, device="cuda")
    mask = {"causal": Mask(), "documents": Mask(rows=torch.stack(_bounds(name, rows)).int()),
            "window": Mask(lo=-(WINDOW - 1)), "softcap": Mask(softcap=SOFTCAP)}[name]
    return (lambda q, k, v: A.attn_fwd(q, k, v, scale, True, 0, out_dtype=q.dtype, mask=mask)[0]), "attn_fwd"


def flex_fn(name: str, sinks: torch.Tensor):
    """FlexAttention (compiled) for variant ``name``; sinks merged after it from its lse."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    # each variant's Flex compiles afresh: dynamo keeps one cache per code object, and the graphs of
    # the variants before (with and without grad) fill flex_attention's, past which a call runs the
    # unfused eager kernel (64 GiB of scores at 32k)
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    doc = S // DOCS
    mods = {"documents": lambda b, h, i, j: (i >= j) & (i // doc == j // doc),
            "window": lambda b, h, i, j: (i >= j) & (i - j < WINDOW)}
    block = create_block_mask(mods.get(name, lambda b, h, i, j: i >= j), None, None, S, S, device="cuda")
    score = (lambda s, b, h, i, j: SOFTCAP * torch.tanh(s / SOFTCAP)) if name == "softcap" else None
    if name != "sinks":
        return lambda q, k, v: flex(q, k, v, score_mod=score, block_mask=block)

    def run(q, k, v):
        out, aux = flex(q, k, v, block_mask=block, return_aux=AuxRequest(lse=True))
        w = torch.sigmoid(aux.lse - sinks.float().view(1, -1, 1))  # the sink's partial: out 0, lse = sink
        return (out.float() * w.unsqueeze(-1)).to(q.dtype)
    return run


def cudnn_fn(name: str):
    """SDPA cuDNN where it expresses the variant (None elsewhere)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    if name == "causal":
        return sdpa
    if name == "documents":  # equal documents: a batch of causal sequences
        def docs(q, k, v):
            split = [t.view(DOCS, t.shape[1], S // DOCS, t.shape[-1]) for t in (q, k, v)]
            return sdpa(*split).view(q.shape)
        return docs
    return None


def _reference(q, k, v, name, rows, sinks, low):
    """Rows ``rows`` of variant ``name`` in float64, or (``low``) as torch computes it in bf16."""
    lo, hi = _bounds(name, rows)
    g = q.shape[1] // k.shape[1]
    dt = torch.bfloat16 if low else torch.float64
    kk, vv = k.to(dt).repeat_interleave(g, 1), v.to(dt).repeat_interleave(g, 1)
    s = (q[:, :, rows].to(dt) @ kk.transpose(-1, -2)).double() * D ** -0.5
    if name == "softcap":
        s = SOFTCAP * torch.tanh(s / SOFTCAP)
    j = torch.arange(k.shape[2], device=q.device)
    s = s.masked_fill(~((j >= lo[:, None]) & (j < hi[:, None])), float("-inf"))
    if name == "sinks":
        s = torch.cat([s, sinks.double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    p = torch.softmax(s, -1)[..., :k.shape[2]]
    return (p.to(dt) @ vv).double()


def _err(out, q, k, v, name, rows, sinks) -> tuple[float, float]:
    """(error of ``out``, error of torch's bf16 attention) on ``rows`` against float64."""
    want = _reference(q, k, v, name, rows, sinks, low=False)
    got = out[:, :, rows].double()
    peer = _reference(q, k, v, name, rows, sinks, low=True)
    return (float("nan") if torch.isnan(got).any() else (got - want).abs().max().item(),
            (peer - want).abs().max().item())


def _time(rec: dict, key: str, fn, flops: float, q, k, v) -> None:
    try:
        with torch.no_grad():
            rec[key] = flops / best_ms(lambda: fn(q, k, v), rep=100) / 1e9
    except Exception as e:  # noqa: BLE001 (a peer may not build here)
        rec[f"{key}_error"] = repr(e)[:200]


def _time_fb(rec: dict, key: str, fn, flops: float, q, k, v) -> None:
    """Forward+backward TFLOP/s (3.5x the forward's products) of ``fn`` on leaf copies of q, k, v."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)
    try:
        rec[key] = 3.5 * flops / best_ms(lambda: fn(*leaves).backward(dout), rep=60, grad_to_none=leaves) / 1e9
    except Exception as e:  # noqa: BLE001 (a peer may not build here)
        rec[f"{key}_error"] = repr(e)[:200]


def variant_rows(backward: bool = True) -> list[dict]:
    """Forward (and forward+backward) TFLOP/s over visible pairs of each variant: ss, Flex, cuDNN
    where it can."""
    res = []
    q, k, v = (torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    sinks = torch.randn(H, device="cuda") + 2.0
    rows = torch.linspace(0, S - 1, 64, device="cuda").long()
    for name in VARIANTS:
        flops = 4.0 * H * D * visible_pairs(name)
        fn, via = ss_fn(name, sinks)
        rec = {"variant": name, "S": S, "H": H, "ss_via": via}
        with torch.no_grad():
            rec["err"], rec["torch_bf16_err"] = _err(fn(q, k, v), q, k, v, name, rows, sinks)
        timings = [("ss", fn)]
        try:
            flex = flex_fn(name, sinks)
            with torch.no_grad():
                rec["flex_err"] = _err(flex(q, k, v), q, k, v, name, rows, sinks)[0]
            timings.append(("flex", flex))
        except Exception as e:  # noqa: BLE001
            rec["flex_error"] = repr(e)[:200]
        rec["correct"] = rec["err"] <= 2 * rec.get("flex_err", rec["torch_bf16_err"]) + 1e-6
        cudnn = cudnn_fn(name)
        if cudnn is not None:
            timings.append(("cudnn", cudnn))
        for impl, f in timings:
            _time(rec, f"{impl}_fwd", f, flops, q, k, v)
            if backward:
                _time_fb(rec, f"{impl}_fb", f, flops, q, k, v)
        res.append(rec)
        print(json.dumps(rec), flush=True)
    return res


def _bshd_views(b, h, s, d):
    return torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)


def layout_rows(seqs=GQA_SEQS) -> list[dict]:
    """Forward TFLOP/s of GQA at batch 1, causal, contiguous and as (B, S, H, D) views."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return run
    methods = {"ss": lambda q, k, v: ss.attention(q, k, v, causal=True),
               "ss_kernel": lambda q, k, v: A.attn_fwd(q, k, v, D ** -0.5, True, 0, out_dtype=q.dtype)[0],
               "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    res = []
    for s in seqs:
        for h, hkv in GQA:
            for views in (False, True):
                make = _bshd_views if views else (lambda b, n, sl, d: torch.randn(b, n, sl, d, device="cuda",
                                                                                  dtype=torch.bfloat16))
                q, k, v = make(1, h, s, D), make(1, hkv, s, D), make(1, hkv, s, D)
                flops = 4.0 * h * D * s * (s + 1) / 2
                rows = torch.linspace(0, s - 1, 64, device="cuda").long()
                rec = {"S": s, "H": h, "Hkv": hkv, "layout": "bshd views" if views else "contiguous"}
                with torch.no_grad():
                    out = methods["ss"](q, k, v)
                    rec["err"], bar = _err(out, q, k, v, "causal", rows, None)
                    try:
                        bar = rec["cudnn_err"] = _err(methods["cudnn"](q, k, v), q, k, v, "causal", rows, None)[0]
                    except Exception as e:  # noqa: BLE001 (then torch's bf16 attention sets the bar)
                        rec["cudnn_error"] = repr(e)[:200]
                rec["correct"] = rec["err"] <= 2 * bar + 1e-6
                rec["ss_out_bshd"] = out.transpose(1, 2).is_contiguous()
                for n, f in methods.items():
                    fin = (lambda f: lambda q, k, v: f(q, k, v).transpose(1, 2).contiguous())(f) if views else f
                    _time(rec, f"{n}_fwd", fin, flops, q, k, v)
                res.append(rec)
                print(json.dumps(rec), flush=True)
                del q, k, v
    return res


def table_lines(variants: list[dict], layouts: list[dict]) -> list[str]:
    nan = float("nan")
    lines = []
    for part in ("fwd", "fb"):
        lines.append(f"variant (32k, H=16, B=1) {part:>3} | ss     flex  cudnn  ss/flex  ss/causal | ok")
        causal = next((r.get(f"ss_{part}", nan) for r in variants if r["variant"] == "causal"), nan)
        for r in variants:
            ss_, flex = r.get(f"ss_{part}", nan), r.get(f"flex_{part}", nan)
            lines.append(f"{r['variant']:<28} | {ss_:6.0f} {flex:5.0f} {r.get(f'cudnn_{part}', nan):6.0f} "
                         f"{ss_ / flex:8.2f} {ss_ / causal:9.2f} | {r['correct']}")
    lines.append("GQA B=1 causal            | ss fwd  kernel  cudnn  flash  ss/cudnn | ok")
    for r in layouts:
        lines.append(f"{r['S']:>5} {r['H']}/{r['Hkv']} {r['layout']:<11} | {r.get('ss_fwd', nan):6.0f} "
                     f"{r.get('ss_kernel_fwd', nan):7.0f} {r.get('cudnn_fwd', nan):6.0f} "
                     f"{r.get('flash_fwd', nan):6.0f} "
                     f"{r.get('ss_fwd', nan) / r.get('cudnn_fwd', nan):8.2f} | {r['correct']}")
    return lines


if __name__ == "__main__":
    v_rows, l_rows = variant_rows(), layout_rows()
    print("\n".join(table_lines(v_rows, l_rows)))
    sys.exit(0 if all(r["correct"] for r in v_rows + l_rows) else 1)
