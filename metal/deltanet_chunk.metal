// Gated DeltaNet recurrence, chunked form (docs/model.md §4.3 step 7): the WY/UT transform of the CUDA kernels
// (csrc/cuda/deltanet_chunk.cu: same math, same names), chunk C = 64, every matrix product on 8x8 simdgroup
// matrices with fp32 accumulation. It reads and writes the same fp32 state [Hv, Dv, Dk] as deltanet_scan
// (deltanet.metal), so the prefill chunks of one prompt may alternate forms; o [S, Hv, Dv] is the output
// before the gated RMSNorm (deltanet_gated_norm follows).
//
// Math (MLX layout: state S[dv, dk], read m = S k). Inside a chunk with incoming state S0, token i has
// lg_i = sum_{j<=i} log g_j, gamma_i = exp(lg_i); with A[i,j] = beta_i (gamma_i/gamma_j)(k_i.k_j) for j < i and
// T = (I + A)^-1:  W = T diag(beta gamma) K [C, Dk],  U = T diag(beta) V [C, Dv],  Delta = U - W S0^T,
//   O[i]  = gamma_i S0 q_i + sum_{j<=i} P[i,j] delta_j,   P[i,j] = (gamma_i/gamma_j)(q_i.k_j) (j <= i),
//   S_end = gamma_last S0 + sum_j (gamma_last/gamma_j) delta_j k_j^T.
// Every ratio is exp(lg_i - lg_j) with lg_i <= lg_j: nothing overflows, tiny decays underflow to 0.
//
// Two kernels, as on CUDA: deltanet_chunk_prep (one threadgroup per (chunk, value head), all chunks in parallel)
// l2-normalises q and k, forms the gates, the Gram products K K^T and Q K^T (simdgroup matrices), solves for
// W and U by forward substitution (one column per thread, fp32), and writes the per-chunk operands of the
// state walk to scratch; deltanet_chunk_state (one threadgroup per (32 state rows, value head)) walks the chunks in
// order with its state slice in threadgroup memory. Apple GPUs give a threadgroup 32 KB, so the chunk
// operands stay in device memory and are read by simdgroup_load directly; only the state slice, Delta and an
// 8x8 staging tile per simdgroup live in threadgroup memory (26.9 KB at Dk = 128).
//
// Scratch, per (value head h, chunk n), hn = h * NC + n, NC = ceil(S / 64); rows past the prompt are zero:
//   W  [Hv, NC, 64, DKP]   T diag(beta gamma) K        (DKP = 32 NK >= Dk; columns past Dk zero)
//   U  [Hv, NC, 64, Dv]    T diag(beta) V
//   P  [Hv, NC, 64, 64]    causal (gamma_i/gamma_j) q_i.k_j, zero above the diagonal
//   Qg [Hv, NC, 64, DKP]   gamma_i q_i (q l2-normalised and scaled by Dk^-1/2)
//   Kd [Hv, NC, 64, DKP]   (gamma_last/gamma_i) k_i (k l2-normalised)
//   LG [Hv, NC, 64]        lg_i (constant over the rows past the prompt: log g = 0 there)
#include "common.h"

constant constexpr uint kChunk = 64;          // C: tokens per chunk
constant constexpr uint kChunkThreads = 256;  // threads of both kernels: 8 simdgroups, one 8-row tile each
constant constexpr uint kStateRows = 32;      // state rows (dv) per threadgroup of deltanet_chunk_state

// log(1 + e^x), the formula of deltanet.metal's softplus (the two forms must give the same gates).
inline float softplus_gate(float x) { return x > 20.0f ? x : (x < -15.0f ? exp(x) : log(1.0f + exp(x))); }

// Kernel 1, per (chunk n = tg.x, value head h = tg.y).
template <int NK>
kernel void deltanet_chunk_prep(device const float*         u      [[buffer(0)]],    // [S, C] q | k | v (post conv)
                           device const float*         bb     [[buffer(1)]],    // [S, Hv] beta logits
                           device const float*         aa     [[buffer(2)]],    // [S, Hv] decay inputs
                           device const float*         a_log  [[buffer(3)]],    // [Hv]
                           device const float*         dt_b   [[buffer(4)]],    // [Hv]
                           device float*               w_out  [[buffer(5)]],    // [Hv, NC, 64, DKP]
                           device float*               u_out  [[buffer(6)]],    // [Hv, NC, 64, Dv]
                           device float*               p_out  [[buffer(7)]],    // [Hv, NC, 64, 64]
                           device float*               q_out  [[buffer(8)]],    // [Hv, NC, 64, DKP]
                           device float*               k_out  [[buffer(9)]],    // [Hv, NC, 64, DKP]
                           device float*               lg_out [[buffer(10)]],   // [Hv, NC, 64]
                           constant kp::DeltaNetParams& p     [[buffer(11)]],
                           uint2 tg   [[threadgroup_position_in_grid]],
                           uint  tid  [[thread_index_in_threadgroup]],
                           uint  sg   [[simdgroup_index_in_threadgroup]],
                           uint  lane [[thread_index_in_simdgroup]])
{
    constexpr uint DKP = 32 * NK;
    threadgroup float tg_at[kChunk * kChunk];   // A transposed: tg_at[j * 64 + i] = A[i, j]
    threadgroup float tg_stage[8 * 128];        // per simdgroup: one 8x8 tile of K K^T and one of Q K^T
    threadgroup float tg_lg[kChunk];
    threadgroup float tg_beta[kChunk];
    threadgroup float tg_rq[kChunk];            // 1 / |q_i| * Dk^-1/2 (0 past the prompt)
    threadgroup float tg_rk[kChunk];            // 1 / |k_i|

    const uint Hv = uint(p.v_heads), Dk = uint(p.k_dim), Dv = uint(p.v_dim), C = uint(p.conv_dim);
    const uint n = tg.x, h = tg.y, kh = h / (Hv / uint(p.k_heads)), key_dim = uint(p.k_heads) * Dk;
    const uint S = uint(p.S), NC = (S + kChunk - 1) / kChunk;
    const ulong t0 = ulong(n) * kChunk;
    const uint len = min(kChunk, S - n * kChunk);
    const ulong hn = ulong(h) * NC + n;
    device float* W = w_out + hn * kChunk * DKP;
    device float* U = u_out + hn * kChunk * Dv;
    device float* P = p_out + hn * kChunk * kChunk;
    device float* Q = q_out + hn * kChunk * DKP;
    device float* K = k_out + hn * kChunk * DKP;

    // 1. Gates (log g = -exp(A_log) softplus(a + dt_bias); rows past the prompt: g = 1, beta = 0) and the
    //    inverse norms of q and k: simdgroup sg reduces rows 8 sg .. 8 sg + 7 (the sums of deltanet_scan).
    if (tid < kChunk) {
        const bool in = tid < len;
        const ulong ti = (t0 + tid) * Hv + h;
        tg_lg[tid] = in ? -exp(a_log[h]) * softplus_gate(aa[ti] + dt_b[h]) : 0.0f;
        tg_beta[tid] = in ? sigmoid(bb[ti]) : 0.0f;
    }
    const float q_scale = 1.0f / sqrt(float(Dk));
    for (uint r = 0; r < 8; r++) {
        const uint i = 8 * sg + r;
        device const float* row = u + (t0 + min(i, len - 1)) * C;   // clamped: rows past the prompt unused
        float sq = 0.0f, sk = 0.0f;
        for (uint j = 0; j < NK; j++) {
            const uint dk = lane + 32 * j;
            const float q = dk < Dk ? row[kh * Dk + dk] : 0.0f, k = dk < Dk ? row[key_dim + kh * Dk + dk] : 0.0f;
            sq += q * q;
            sk += k * k;
        }
        sq = simd_sum(sq);
        sk = simd_sum(sk);
        if (lane == 0) {
            tg_rq[i] = i < len ? 1.0f / sqrt(sq + p.qk_eps) * q_scale : 0.0f;
            tg_rk[i] = i < len ? 1.0f / sqrt(sk + p.qk_eps) : 0.0f;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {   // inclusive prefix sum (64 adds; not worth a parallel scan)
        float acc = 0.0f;
        for (uint c = 0; c < kChunk; c++) tg_lg[c] = acc += tg_lg[c];
    }
    // 2. Normalised q and k, zero-padded to [64, DKP], into the Qg / Kd slots (scaled by the decays in step 5).
    for (uint e = tid; e < kChunk * DKP; e += kChunkThreads) {
        const uint i = e / DKP, d = e % DKP;
        const bool in = i < len && d < Dk;
        device const float* row = u + (t0 + min(i, len - 1)) * C;
        Q[e] = in ? row[kh * Dk + d] * tg_rq[i] : 0.0f;
        K[e] = in ? row[key_dim + kh * Dk + d] * tg_rk[i] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);

    // 3. Gram tiles: simdgroup sg owns row tile sg (rows 8 sg ..), column tiles jt <= sg are products, the rest
    //    zero; A goes to threadgroup memory (transposed), P to scratch.
    threadgroup float* stage = tg_stage + sg * 128;
    for (uint jt = 0; jt < 8; jt++) {
        if (jt <= sg) {   // uniform per simdgroup
            simdgroup_float8x8 kk = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            simdgroup_float8x8 qk = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            for (uint k0 = 0; k0 < DKP; k0 += 8) {
                simdgroup_float8x8 ak, aq, b;
                simdgroup_load(ak, K, DKP, ulong2(k0, 8 * sg));
                simdgroup_load(aq, Q, DKP, ulong2(k0, 8 * sg));
                simdgroup_load(b, K, DKP, ulong2(k0, 8 * jt), true);   // b[d][j] = k_j[d]
                simdgroup_multiply_accumulate(kk, ak, b, kk);
                simdgroup_multiply_accumulate(qk, aq, b, qk);
            }
            simdgroup_store(kk, stage, 8);
            simdgroup_store(qk, stage + 64, 8);
            simdgroup_barrier(mem_flags::mem_threadgroup);
        }
        for (uint e = lane; e < 64; e += 32) {
            const uint i = 8 * sg + e / 8, j = 8 * jt + e % 8;
            const float kkv = jt <= sg ? stage[e] : 0.0f, qkv = jt <= sg ? stage[64 + e] : 0.0f;
            const float ratio = j <= i ? exp(tg_lg[i] - tg_lg[j]) : 0.0f;
            tg_at[j * kChunk + i] = j < i ? tg_beta[i] * ratio * kkv : 0.0f;
            P[i * kChunk + j] = ratio * qkv;
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);   // the stage is rewritten by the next tile
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 4. W and U columns by forward substitution of (I + A) X = R, one column per thread, in registers.
    //    Right-looking order (x_i -= A[i, j] x_j for all i > j once x_j is final): 63 - j independent FMAs per
    //    step instead of one dependent chain. Columns DKP .. DKP + Dv are U's; W's past Dk are zero.
    for (uint col = tid; col < DKP + Dv; col += kChunkThreads) {
        const bool is_w = col < DKP;
        float x[kChunk];
        for (uint i = 0; i < kChunk; i++) {
            const float r = is_w ? (col < Dk ? exp(tg_lg[i]) * K[i * DKP + col] : 0.0f)
                                 : (i < len ? u[(t0 + i) * C + 2 * key_dim + h * Dv + col - DKP] : 0.0f);
            x[i] = tg_beta[i] * r;
        }
        for (uint j = 0; j + 1 < kChunk; j++) {
            threadgroup const float* acol = tg_at + j * kChunk;
            for (uint i = j + 1; i < kChunk; i++) x[i] = fma(-acol[i], x[j], x[i]);
        }
        for (uint i = 0; i < kChunk; i++) {
            if (is_w) W[i * DKP + col] = x[i];
            else U[i * Dv + col - DKP] = x[i];
        }
    }
    threadgroup_barrier(mem_flags::mem_device);   // step 4 read K; step 5 rescales it in place

    // 5. Qg = gamma_i q_i, Kd = (gamma_last / gamma_i) k_i, and the cumulative log decays.
    const float lg_last = tg_lg[kChunk - 1];
    for (uint e = tid; e < kChunk * DKP; e += kChunkThreads) {
        const uint i = e / DKP;
        Q[e] *= exp(tg_lg[i]);
        K[e] *= exp(lg_last - tg_lg[i]);
    }
    if (tid < kChunk) lg_out[hn * kChunk + tid] = tg_lg[tid];
}

// Kernel 2, per (state rows dv0 = 32 tg.x .., value head h = tg.y): the chunks in order. Simdgroup sg owns chunk
// rows 8 sg .. 8 sg + 7 in steps 1 and 2 and every eighth 8x8 state tile in step 3.
template <int NK>
kernel void deltanet_chunk_state(device const float*         w_in  [[buffer(0)]],   // [Hv, NC, 64, DKP]
                            device const float*         u_in  [[buffer(1)]],   // [Hv, NC, 64, Dv]
                            device const float*         p_in  [[buffer(2)]],   // [Hv, NC, 64, 64]
                            device const float*         q_in  [[buffer(3)]],   // [Hv, NC, 64, DKP]
                            device const float*         k_in  [[buffer(4)]],   // [Hv, NC, 64, DKP]
                            device const float*         lg_in [[buffer(5)]],   // [Hv, NC, 64]
                            device float*               state [[buffer(6)]],   // [Hv, Dv, Dk] in/out
                            device float*               out   [[buffer(7)]],   // [S, Hv, Dv]
                            constant kp::DeltaNetParams& p    [[buffer(8)]],
                            uint2 tg   [[threadgroup_position_in_grid]],
                            uint  tid  [[thread_index_in_threadgroup]],
                            uint  sg   [[simdgroup_index_in_threadgroup]],
                            uint  lane [[thread_index_in_simdgroup]])
{
    constexpr uint DKP = 32 * NK, R = kStateRows;
    threadgroup float tg_s[R * DKP];      // state slice S[dv0 + v][d]; zero past Dv and Dk
    threadgroup float tg_d[kChunk * R];   // Delta[c][v]
    threadgroup float tg_o[8 * 64];       // per simdgroup: one 8x8 output tile on its way to `out`

    const uint Hv = uint(p.v_heads), Dk = uint(p.k_dim), Dv = uint(p.v_dim);
    const uint h = tg.y, dv0 = tg.x * R;
    const uint S = uint(p.S), NC = (S + kChunk - 1) / kChunk;
    device float* st_h = state + ulong(h) * Dv * Dk;
    for (uint e = tid; e < R * DKP; e += kChunkThreads) {
        const uint v = e / DKP, d = e % DKP;
        tg_s[e] = dv0 + v < Dv && d < Dk ? st_h[ulong(dv0 + v) * Dk + d] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    threadgroup float* stage = tg_o + sg * 64;

    for (uint n = 0; n < NC; n++) {
        const ulong hn = ulong(h) * NC + n, t0 = ulong(n) * kChunk;
        const uint len = min(kChunk, S - n * kChunk);
        device const float* W = w_in + hn * kChunk * DKP;
        device const float* U = u_in + hn * kChunk * Dv;
        device const float* P = p_in + hn * kChunk * kChunk;
        device const float* Qg = q_in + hn * kChunk * DKP;
        device const float* Kd = k_in + hn * kChunk * DKP;

        // Step 1: WS = W S^T and QS = Qg S^T for this simdgroup's 8 rows, 4 column tiles (32 state rows).
        simdgroup_float8x8 ws[4], qs[4];
        for (uint vt = 0; vt < 4; vt++) {
            ws[vt] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            qs[vt] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        }
        for (uint k0 = 0; k0 < DKP; k0 += 8) {
            simdgroup_float8x8 aw, aq, b;
            simdgroup_load(aw, W, DKP, ulong2(k0, 8 * sg));
            simdgroup_load(aq, Qg, DKP, ulong2(k0, 8 * sg));
            for (uint vt = 0; vt < 4; vt++) {
                simdgroup_load(b, tg_s, DKP, ulong2(k0, 8 * vt), true);   // b[d][v] = S[v][d]
                simdgroup_multiply_accumulate(ws[vt], aw, b, ws[vt]);
                simdgroup_multiply_accumulate(qs[vt], aq, b, qs[vt]);
            }
        }
        // Delta = U - WS (rows past the prompt: U = 0 and W = 0, so Delta = 0; columns past Dv: 0).
        for (uint vt = 0; vt < 4; vt++) simdgroup_store(ws[vt], tg_d, R, ulong2(8 * vt, 8 * sg));
        simdgroup_barrier(mem_flags::mem_threadgroup);
        for (uint e = lane; e < 8 * R; e += 32) {
            const uint c = 8 * sg + e / R, v = e % R;
            tg_d[c * R + v] = (dv0 + v < Dv ? U[c * Dv + dv0 + v] : 0.0f) - tg_d[c * R + v];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);   // Delta complete; step 1's reads of tg_s are done

        // S *= gamma_last now (step 2 does not read tg_s), so step 3 starts from its tiles as they are.
        const float gl = exp(lg_in[hn * kChunk + kChunk - 1]);
        for (uint e = tid; e < R * DKP; e += kChunkThreads) tg_s[e] *= gl;

        // Step 2: O = QS + P Delta; P is causal, so only the k-tiles up to this row tile.
        for (uint kt = 0; kt <= sg; kt++) {
            simdgroup_float8x8 pa, b;
            simdgroup_load(pa, P, kChunk, ulong2(8 * kt, 8 * sg));
            for (uint vt = 0; vt < 4; vt++) {
                simdgroup_load(b, tg_d, R, ulong2(8 * vt, 8 * kt));
                simdgroup_multiply_accumulate(qs[vt], pa, b, qs[vt]);
            }
        }
        for (uint vt = 0; vt < 4; vt++) {
            simdgroup_store(qs[vt], stage, 8);
            simdgroup_barrier(mem_flags::mem_threadgroup);
            for (uint e = lane; e < 64; e += 32) {
                const uint c = 8 * sg + e / 8, v = dv0 + 8 * vt + e % 8;
                if (c < len && v < Dv) out[((t0 + c) * Hv + h) * Dv + v] = stage[e];
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);   // tg_s scaled

        // Step 3: S += Delta^T Kd, tile (vt, dt) = rows 8 vt .., columns 8 dt ..; each tile has one owner.
        for (uint tile = sg; tile < 4 * (DKP / 8); tile += 8) {
            const uint vt = tile % 4, dt = tile / 4;
            simdgroup_float8x8 acc, a, b;
            simdgroup_load(acc, tg_s, DKP, ulong2(8 * dt, 8 * vt));
            for (uint c0 = 0; c0 < kChunk; c0 += 8) {
                simdgroup_load(a, tg_d, R, ulong2(8 * vt, c0), true);   // a[v][c] = Delta[c][v]
                simdgroup_load(b, Kd, DKP, ulong2(8 * dt, c0));
                simdgroup_multiply_accumulate(acc, a, b, acc);
            }
            simdgroup_store(acc, tg_s, DKP, ulong2(8 * dt, 8 * vt));
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);   // the next chunk reads tg_s and rewrites tg_d
    }
    for (uint e = tid; e < R * DKP; e += kChunkThreads) {
        const uint v = e / DKP, d = e % DKP;
        if (dv0 + v < Dv && d < Dk) st_h[ulong(dv0 + v) * Dk + d] = tg_s[e];
    }
}

template [[host_name("deltanet_chunk_prep_nk1")]] [[kernel]] decltype(deltanet_chunk_prep<1>) deltanet_chunk_prep<1>;
template [[host_name("deltanet_chunk_prep_nk2")]] [[kernel]] decltype(deltanet_chunk_prep<2>) deltanet_chunk_prep<2>;
template [[host_name("deltanet_chunk_prep_nk4")]] [[kernel]] decltype(deltanet_chunk_prep<4>) deltanet_chunk_prep<4>;
template [[host_name("deltanet_chunk_state_nk1")]] [[kernel]] decltype(deltanet_chunk_state<1>) deltanet_chunk_state<1>;
template [[host_name("deltanet_chunk_state_nk2")]] [[kernel]] decltype(deltanet_chunk_state<2>) deltanet_chunk_state<2>;
template [[host_name("deltanet_chunk_state_nk4")]] [[kernel]] decltype(deltanet_chunk_state<4>) deltanet_chunk_state<4>;
