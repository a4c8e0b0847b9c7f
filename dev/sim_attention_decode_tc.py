"""Lane-level NumPy simulation of csrc/cuda/attention_decode_tc.cu's index math, against plain attention.

Each lane's fragment loads are transcribed from the kernel; mma.m16n8k16 and ldmatrix.x4.trans are modelled by
the PTX ISA's fragment layouts (the same reading the GPU-verified prefill kernel attention_mma.cu relies on). It
checks the transcription's layouts and the online softmax, not the hardware and not the .cu file itself: keep it
in step with the kernel when the kernel's indexing changes. A swapped ldmatrix row mapping fails it (rel error
~1). Run by hand: python3 dev/sim_attention_decode_tc.py (about a minute)."""
import numpy as np

G, TILE, WARPS = 8, 64, 4

def bf(x):  # round to bf16 (nearest even)
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)

def mma(c_frags, a_frags, b_frags):
    """c_frags[lane] (4), a_frags[lane] = 4 pairs, b_frags[lane] = 2 pairs -> new c_frags, by the PTX layouts."""
    A = np.zeros((16, 16)); B = np.zeros((16, 8)); C = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a = a_frags[lane]
        for (r, c0), pair in zip([(g, 2*t), (g+8, 2*t), (g, 2*t+8), (g+8, 2*t+8)], a):
            A[r, c0], A[r, c0+1] = pair
        b = b_frags[lane]
        for (k0, n), pair in zip([(2*t, g), (2*t+8, g)], b):
            B[k0, n], B[k0+1, n] = pair
        cf = c_frags[lane]
        C[g, 2*t], C[g, 2*t+1], C[g+8, 2*t], C[g+8, 2*t+1] = cf
    C = C + A @ B
    out = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        out.append([C[g, 2*t], C[g, 2*t+1], C[g+8, 2*t], C[g+8, 2*t+1]])
    return out

def ldmatrix_x4_trans(smem, row_addr):
    """smem: 2-D array (rows x cols) of bf16 values; row_addr[lane] = (row, col) of the 8-element row lane points
    at (lanes 8j..8j+7 give matrix j's rows 0..7). Returns regs[lane][j] = (lo, hi)."""
    regs = [[None]*4 for _ in range(32)]
    for j in range(4):
        rows = [smem[row_addr[8*j + r][0], row_addr[8*j + r][1]: row_addr[8*j + r][1] + 8] for r in range(8)]
        M = np.array(rows)  # stored 8x8: M[r][c]
        for T in range(32):
            regs[T][j] = (M[2*(T % 4), T // 4], M[2*(T % 4) + 1, T // 4])
    return regs

def kernel(Q, K, V, scale, split0, split_len, pos0):
    D = Q.shape[1]
    Qs = bf(Q)
    end = min(split0 + split_len, pos0 + 1)
    n_tiles = (end - split0 + TILE - 1) // TILE if end > split0 else 0
    kmt = D // WARPS // 16
    m = {(w, l): [-np.inf, -np.inf] for w in range(WARPS) for l in range(32)}
    lsum = {(w, l): [0.0, 0.0] for w in range(WARPS) for l in range(32)}
    o = {(w, l): [[0.0]*4 for _ in range(kmt)] for w in range(WARPS) for l in range(32)}
    for it in range(n_tiles):
        k0 = split0 + it * TILE
        Ks = np.zeros((TILE, D), np.float32); Vs = np.zeros((TILE, D), np.float32)
        for r in range(TILE):
            if k0 + r < end:
                Ks[r] = bf(K[k0 + r]); Vs[r] = bf(V[k0 + r])
        red = np.zeros((WARPS, G))
        sc_all = {}
        for w in range(WARPS):
            c = [[0.0]*4 for _ in range(32)]
            for k in range(0, D, 16):
                a, b = [], []
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    row = 16*w + g
                    a.append([(Ks[row, k+2*t], Ks[row, k+2*t+1]), (Ks[row+8, k+2*t], Ks[row+8, k+2*t+1]),
                              (Ks[row, k+2*t+8], Ks[row, k+2*t+9]), (Ks[row+8, k+2*t+8], Ks[row+8, k+2*t+9])])
                    b.append([(Qs[g, k+2*t], Qs[g, k+2*t+1]), (Qs[g, k+2*t+8], Qs[g, k+2*t+9])])
                c = mma(c, a, b)
            for lane in range(32):
                g, t = lane // 4, lane % 4
                va, vb = k0 + 16*w + g < end, k0 + 16*w + g + 8 < end
                cc = c[lane]
                sc = [[cc[0]*scale if va else -np.inf, cc[1]*scale if va else -np.inf],
                      [cc[2]*scale if vb else -np.inf, cc[3]*scale if vb else -np.inf]]
                sc_all[(w, lane)] = sc
            for t in range(4):  # warp max over g for heads 2t, 2t+1
                for j in range(2):
                    red[w, 2*t+j] = max(max(sc_all[(w, 4*g+t)][0][j], sc_all[(w, 4*g+t)][1][j]) for g in range(8))
        Ps = np.zeros((G, TILE), np.float32)
        for w in range(WARPS):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for j in range(2):
                    mt = red[:, 2*t+j].max()
                    mn = max(m[(w, lane)][j], mt)
                    corr = np.exp(m[(w, lane)][j] - mn)
                    pa, pb = np.exp(sc_all[(w, lane)][0][j] - mn), np.exp(sc_all[(w, lane)][1][j] - mn)
                    lsum[(w, lane)][j] = lsum[(w, lane)][j]*corr + pa + pb
                    Ps[2*t+j, 16*w+g] = bf(pa); Ps[2*t+j, 16*w+g+8] = bf(pb)
                    m[(w, lane)][j] = mn
                    for i in range(kmt):
                        o[(w, lane)][i][j] *= corr; o[(w, lane)][i][2+j] *= corr
        for w in range(WARPS):
            for kk in range(0, TILE, 16):
                b = []
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    b.append([(Ps[g, kk+2*t], Ps[g, kk+2*t+1]), (Ps[g, kk+2*t+8], Ps[g, kk+2*t+9])])
                for i in range(kmt):
                    md = w * (D // WARPS) + 16*i
                    addr = []
                    for lane in range(32):
                        lr, lm = lane % 8, lane // 8
                        addr.append((kk + lr + (8 if lm >= 2 else 0), md + (lm & 1) * 8))
                    regs = ldmatrix_x4_trans(Vs, addr)
                    c = [o[(w, lane)][i] for lane in range(32)]
                    c = mma(c, [regs[lane] for lane in range(32)], b)
                    for lane in range(32):
                        o[(w, lane)][i] = c[lane]
    # outputs
    outm, outl, outo = np.zeros(G), np.zeros(G), np.zeros((G, D))
    for w in range(WARPS):
        for t in range(4):
            for j in range(2):
                tot = sum(lsum[(w, 4*g+t)][j] for g in range(8))
                outl[2*t+j] += tot
                outm[2*t+j] = m[(w, t)][j]
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for j in range(2):
                for i in range(kmt):
                    md = w * (D // WARPS) + 16*i
                    outo[2*t+j, md+g] = o[(w, lane)][i][j]
                    outo[2*t+j, md+g+8] = o[(w, lane)][i][2+j]
    return outm, outl, outo

rng = np.random.default_rng(0)
for D, pos0, split0, split_len in [(256, 100, 0, 128), (128, 70, 64, 64), (256, 150, 64, 96), (128, 5, 0, 64)]:
    Q = rng.standard_normal((G, D)).astype(np.float32)
    K = rng.standard_normal((pos0 + 1, D)).astype(np.float32)
    V = rng.standard_normal((pos0 + 1, D)).astype(np.float32)
    scale = D ** -0.5
    m, l, o = kernel(Q, K, V, scale, split0, split_len, pos0)
    end = min(split0 + split_len, pos0 + 1)
    Kr, Vr = bf(K[split0:end]).astype(np.float64), bf(V[split0:end]).astype(np.float64)
    s = (bf(Q).astype(np.float64) @ Kr.T) * scale
    ref_m = s.max(1)
    p = np.exp(s - ref_m[:, None])
    ref = (p @ Vr) / p.sum(1)[:, None]
    got = o / l[:, None]
    err = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"D={D} pos0={pos0} split [{split0},{end}): m err {np.abs(m - ref_m).max():.2e}, rel out err {err:.2e}")
