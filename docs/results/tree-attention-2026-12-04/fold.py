"""bf16 SDPA probes: chunks of 3 query rows, the chunks folded into the batch, one call; bitwise checks
against the one-token (pack_gqa) reference and timings. Run: .venv/bin/python fold.py"""
import torch, time, statistics
import torch.nn.functional as F
torch.manual_seed(0)
def chunked(q, k, v, m, r=3):
    return torch.cat([F.scaled_dot_product_attention(q[:, :, s:s+r], k, v, attn_mask=m[:, :, s:s+r], enable_gqa=True)
                      for s in range(0, q.shape[2], r)], dim=2)
def folded(q, k, v, m, r=3, expand=False):
    """The chunks of r query rows as batch entries of one SDPA call; keys and values per entry
    by repeat_interleave, or (expand) by a reshaped expand."""
    B, H, n, D = q.shape
    c = -(-n // r); pad = c * r - n
    if pad:
        q = torch.cat([q, q.new_zeros(B, H, pad, D)], 2)
        m = torch.cat([m, m[:, :, :1].expand(B, m.shape[1], pad, m.shape[3])], 2)
    qf = q.reshape(B, H, c, r, D).transpose(1, 2).reshape(B * c, H, r, D)
    mf = m.reshape(B, m.shape[1], c, r, m.shape[3]).transpose(1, 2).reshape(B * c, m.shape[1], r, m.shape[3])
    if expand:
        kf = k[:, None].expand(B, c, *k.shape[1:]).reshape(B * c, *k.shape[1:])
        vf = v[:, None].expand(B, c, *v.shape[1:]).reshape(B * c, *v.shape[1:])
    else:
        kf, vf = k.repeat_interleave(c, 0), v.repeat_interleave(c, 0)
    o = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mf, enable_gqa=True)
    return o.reshape(B, c, H, r, D).transpose(1, 2).reshape(B, H, c * r, D)[:, :, :n]
folded_exp = lambda *a: folded(*a, expand=True)
for B in (1, 4):
  for n in (4, 8, 16):
    S = 300
    q = torch.randn(B, 9, n, 64).bfloat16(); k = torch.randn(B, 3, S, 64).bfloat16(); v = torch.randn(B, 3, S, 64).bfloat16()
    m = torch.rand(B, 1, n, S) > 0.2; m[..., 0] = True
    a = chunked(q, k, v, m); b = folded(q, k, v, m); c2 = folded_exp(q, k, v, m)
    w = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    one = torch.cat([F.scaled_dot_product_attention(q[:, :, s:s+1], k, v, attn_mask=m[:, :, s:s+1], enable_gqa=True) for s in range(n)], 2)
    ts = {}
    for name, f in (("chunk", chunked), ("fold", folded), ("foldexp", folded_exp), ("whole", lambda *a: F.scaled_dot_product_attention(*a[:3], attn_mask=a[3], enable_gqa=True))):
        xs = []
        for _ in range(200):
            t0 = time.perf_counter(); f(q, k, v, m); xs.append(time.perf_counter() - t0)
        ts[name] = statistics.median(xs) * 1e6
    print(B, n, "chunk==one", torch.equal(a, one), "fold==chunk", torch.equal(a, b), torch.equal(a, c2), "whole==one", torch.equal(w, one),
          {k_: round(v_, 1) for k_, v_ in ts.items()})
print("--- vs pack_gqa one-token reference")
def packed_one(q, k, v, m):
    B, H, n, D = q.shape
    outs = []
    for s in range(n):
        qs = q[:, :, s:s+1].reshape(B, 3, 3, D)
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=m[:, :, s:s+1])
        outs.append(o.reshape(B, H, 1, D))
    return torch.cat(outs, 2)
for B in (1, 4):
  for n in (2, 3, 4, 8, 16):
    S = 300
    for trial in range(3):
        q = torch.randn(B, 9, n, 64).bfloat16(); k = torch.randn(B, 3, S, 64).bfloat16(); v = torch.randn(B, 3, S, 64).bfloat16()
        m = torch.rand(B, 1, n, S) > 0.2; m[..., 0] = True
        ref = packed_one(q, k, v, m)
        print(B, n, "chunk", torch.equal(chunked(q, k, v, m), ref), "fold", torch.equal(folded(q, k, v, m), ref),
              "whole", torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True), ref),
              "chunk1", torch.equal(chunked(q, k, v, m, 1), ref))
