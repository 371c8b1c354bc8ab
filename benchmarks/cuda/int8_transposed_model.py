"""A lane-level numpy model of the transposed INT8 step of PagedCacheAttention (custom_ops/kernels/cuda/paged_cuda.cu:
RegQuery<kInt8F, 64>, NarrowTilesT<kInt8F, NT>, MergeWindowT; Note [Paged CUDA v3 transposed INT8]), checked against
float attention over the dequantized keys and values. It runs on any machine (no GPU).

Each of the warp's 32 lanes builds its registers as the kernel does (the same byte offsets into a stage of NT tiles,
the same PRMT selectors, XORs and float16 offsets), and the tensor-core and movmatrix instructions are modelled by
their PTX fragment layouts (mma.m16n8k16: A rows g / g + 8, k 2c / 2c + 8; B k 2c / 2c + 8, column g; C rows g /
g + 8, columns 2c, 2c + 1). So it checks the step's index maps (which key and dim each lane's fragment holds, the
kappa order of S^T's rows, the dim map MergeWindowT reads), not the CUDA code itself: keep it in step with the
kernel by hand, and run the CUDA tests (tests/test_cuda_paged.py) on a GPU for the code.

    python benchmarks/cuda/int8_transposed_model.py        (prints the largest difference; exits 1 on a mismatch)

It was written when the uniform INT8 kernel (Note [Paged CUDA uniform INT8]) was first compiled on a machine with
no GPU; mutating any of the three maps (a PRMT selector, kappa, MergeWindowT's dim map) makes it fail.
"""
import numpy as np
rng = np.random.default_rng(1)
D, NT = 64, 2
RB, KV, KS, STAGE = 64, 16 * 64, 2 * 16 * 64, 2176
f16 = np.float16

def bytes_of(word):  # uint32 -> 4 bytes
    return [(word >> (8 * i)) & 0xFF for i in range(4)]

def word_at(buf, off):
    return int(np.frombuffer(buf[off:off + 4].tobytes(), np.uint32)[0])

def prmt(x, y, sel):
    b = bytes_of(x) + bytes_of(y)
    return sum(b[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))

def half2_bits(w):
    return (np.array([w & 0xFFFF], np.uint16).view(f16)[0], np.array([w >> 16], np.uint16).view(f16)[0])

def int8pair_raw(u, hi):
    return half2_bits(prmt(u, 0x64646464, 0x4342 if hi else 0x4140))

def int8pair(u, hi):
    a, b = int8pair_raw(u, hi)
    return (f16(a - f16(1152)), f16(b - f16(1152)))

def mma(A_frag, B_frag, C):  # A_frag[lane] = 4 half2, B_frag[lane] = 2 half2, C[lane] = 4 floats (m16n8k16)
    A = np.zeros((16, 16), np.float32); B = np.zeros((16, 8), np.float32)
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        a0, a1, a2, a3 = A_frag[lane]
        A[g, 2 * c:2 * c + 2] = a0; A[g + 8, 2 * c:2 * c + 2] = a1
        A[g, 2 * c + 8:2 * c + 10] = a2; A[g + 8, 2 * c + 8:2 * c + 10] = a3
        b0, b1 = B_frag[lane]
        B[2 * c:2 * c + 2, g] = b0; B[2 * c + 8:2 * c + 10, g] = b1
    R = A @ B
    out = []
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        out.append([C[lane][0] + R[g, 2 * c], C[lane][1] + R[g, 2 * c + 1], C[lane][2] + R[g + 8, 2 * c],
                    C[lane][3] + R[g + 8, 2 * c + 1]])
    return out

def movm_trans(vals):  # vals[lane] = half2 (row g, cols 2c, 2c+1) -> transposed
    M = np.zeros((8, 8), f16)
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        M[g, 2 * c], M[g, 2 * c + 1] = vals[lane]
    T = M.T
    return [(T[lane >> 2, 2 * (lane & 3)], T[lane >> 2, 2 * (lane & 3) + 1]) for lane in range(32)]

# ---- data: NT tiles of 16 keys; K/V int8 codes, per-key float16 scales; 8 query heads -------------------------
kc = rng.integers(-128, 128, (NT, 16, D)); vc = rng.integers(-128, 128, (NT, 16, D))
sk = rng.uniform(0.001, 0.02, (NT, 16)).astype(f16); sv = rng.uniform(0.001, 0.02, (NT, 16)).astype(f16)
q = rng.standard_normal((8, D)).astype(f16)
valid_n = 16 * NT - 5  # last keys outside the window
st = np.zeros(NT * STAGE, np.uint8)
for h in range(NT):
    base = h * STAGE
    st[base:base + KV] = (kc[h].astype(np.int8).view(np.uint8)).ravel()
    st[base + KV:base + 2 * KV] = (vc[h].astype(np.int8).view(np.uint8)).ravel()
    st[base + KS:base + KS + 32] = sk[h].view(np.uint8)
    st[base + KS + 64:base + KS + 96] = sv[h].view(np.uint8)
qscale = 1.0 / 8 * 1.4426950408889634

# ---- RegQuery<kInt8F, 64> per lane ------------------------------------------------------------------------------
qa, qsum, k0 = [], [], []
for lane in range(32):
    g, c = lane >> 2, lane & 3
    qc = [(q[g, c * 16 + 2 * i], q[g, c * 16 + 2 * i + 1]) for i in range(8)]
    frags = [[None, None] for _ in range(4)]
    s = 0.0
    for ks in range(4):
        for bi in range(2):
            x, y = qc[2 * ks + bi]
            r = (f16(float(x) * qscale), f16(float(y) * qscale))
            frags[ks][bi] = r
            s += float(r[0]) + float(r[1])
    qa.append(frags); qsum.append(s)
# the quad sums (xor 1, 2)
qsum = [sum(qsum[(l & ~3) + j] for j in range(4)) for l in range(32)]
k0 = [1152.0 * v for v in qsum]

# ---- NarrowTilesT<kInt8F> ----------------------------------------------------------------------------------
kcol = [[k0[8 * (l & 3)], k0[8 * (l & 3) + 4]] for l in range(32)]  # kc[e]: head 2c + e
m = [[-np.inf, -np.inf] for _ in range(32)]; l_ = [[0.0, 0.0] for _ in range(32)]
o = [[[0.0] * 4 for _ in range(4)] for _ in range(32)]
kappa = lambda g: (g >> 1) + 4 * (g & 1)
s_all = []
for h in range(NT):
    t = h * STAGE
    C = [[0.0] * 4 for _ in range(32)]
    for ks in range(4):
        A, B = [], []
        for lane in range(32):
            g, c = lane >> 2, lane & 3
            kg = kappa(g)
            wl = word_at(st, t + kg * RB + c * 16 + 4 * ks) ^ 0x80808080
            wh = word_at(st, t + (8 + kg) * RB + c * 16 + 4 * ks) ^ 0x80808080
            A.append((int8pair_raw(wl, False), int8pair_raw(wh, False), int8pair_raw(wl, True), int8pair_raw(wh, True)))
            B.append(tuple(qa[lane][ks]))
        C = mma(A, B, C)
    s_all.append(C)
mx = [[-np.inf, -np.inf] for _ in range(32)]
S = []
for h in range(NT):
    Sh = []
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        kg = kappa(g)
        row = []
        for hi in range(2):
            k = 8 * hi + kg
            skk = float(sk[h, k]); ok = 16 * h + k < valid_n
            for e in range(2):
                x = s_all[h][lane][2 * hi + e]
                x = x * skk - skk * kcol[lane][e] if ok else -np.inf
                row.append(x); mx[lane][e] = max(mx[lane][e], x)
        Sh.append(row)
    S.append(Sh)
for e in range(2):  # max over the 8 lanes of a column (xor 4, 8, 16)
    col = {}
    for lane in range(32):
        col.setdefault(lane & 3, []).append(mx[lane][e])
    for lane in range(32):
        mx[lane][e] = max(col[lane & 3])
for lane in range(32):
    for e in range(2):
        if mx[lane][e] > m[lane][e]:
            m[lane][e] = mx[lane][e]
for h in range(NT):
    pv = []
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        kg = kappa(g)
        vals = [[0, 0], [0, 0]]
        for hi in range(2):
            k = 8 * hi + kg
            ok = 16 * h + k < valid_n
            for e in range(2):
                p = 2.0 ** (S[h][lane][2 * hi + e] - m[lane][e])
                l_[lane][e] += p
                vals[hi][e] = p * (float(sv[h, k]) if ok else 0.0)
        pv.append(vals)
    b0 = movm_trans([(f16(pv[l][0][0]), f16(pv[l][0][1])) for l in range(32)])
    b1 = movm_trans([(f16(pv[l][1][0]), f16(pv[l][1][1])) for l in range(32)])
    afr = []
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        v = h * STAGE + KV + 8 * g
        a = [[[None] * 4 for _ in range(2)] for _ in range(2)]
        for hf in range(2):
            x0 = (word_at(st, v + (8 * hf + c) * RB), word_at(st, v + (8 * hf + c) * RB + 4))
            x1 = (word_at(st, v + (8 * hf + c + 4) * RB), word_at(st, v + (8 * hf + c + 4) * RB + 4))
            for dh in range(2):
                p_, q_ = x0[dh], x1[dh]
                lo = prmt(p_, q_, 0x5140) ^ 0x80808080; hi_ = prmt(p_, q_, 0x7362) ^ 0x80808080
                a[hf][dh] = [int8pair(lo, False), int8pair(lo, True), int8pair(hi_, False), int8pair(hi_, True)]
        afr.append(a)
    for mt in range(4):
        A = [(afr[l][0][0][mt], afr[l][0][1][mt], afr[l][1][0][mt], afr[l][1][1][mt]) for l in range(32)]
        B = [(b0[l], b1[l]) for l in range(32)]
        res = mma(A, B, [o[l][mt] for l in range(32)])
        for l in range(32):
            o[l][mt] = res[l]
# ---- MergeWindowT: buf[head][dim] -------------------------------------------------------------------------------
buf = np.zeros((8, 65)); lsum = np.zeros(8)
for lane in range(32):
    g, c = lane >> 2, lane & 3
    for mt in range(4):
        for e in range(4):
            buf[2 * c + (e & 1), 8 * g + mt + 4 * (e >> 1)] = o[lane][mt][e]
for e in range(2):
    for c in range(4):
        lsum[2 * c + e] = sum(l_[lane][e] for lane in range(32) if lane & 3 == c)
got = buf[:, :64] / lsum[:, None]
# ---- reference ----------------------------------------------------------------------------------------------------
K = (kc * sk[..., None].astype(np.float32)).reshape(-1, D)[:valid_n]
V = (vc * sv[..., None].astype(np.float32)).reshape(-1, D)[:valid_n]
sc = (q.astype(np.float32) @ K.T) / 8
p = np.exp(sc - sc.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
want = p @ V
print("max |diff|", np.abs(got - want).max(), "max |want|", np.abs(want).max())
if not np.allclose(got, want, atol=2e-2 * np.abs(want).max() + 1e-3):
    raise SystemExit(f"mismatch: got {got[:2, :8]}, want {want[:2, :8]}")
print("ok")
