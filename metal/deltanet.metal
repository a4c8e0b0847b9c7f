// Gated DeltaNet mixer core (docs/model.md §4.3; docs/metal.md, Kernels: DeltaNet): causal conv + SiLU, then the
// recurrence with the state kept in registers for the whole chunk, and the gated RMSNorm.
// Layouts: u [S, C] = conv output, channels q | k | v; state [Hv, Dv, Dk] fp32 (MLX layout); conv state
// [K-1, C] (pre-conv rows, oldest first); o / y [S, Hv, Dv]. Value head h reads key head h / (Hv/Hk).
#include "common.h"

// log(1 + e^x); MSL has no log1p, so the far-negative tail uses softplus(x) ~ e^x (exact to float there).
inline float softplus(float x) { return x > 20.0f ? x : (x < -15.0f ? exp(x) : log(1.0f + exp(x))); }

// u[t, c] = silu(sum_j w[c, j] X[t + j, c]) with X = [conv_state; qkv]; then conv_state = last K-1 rows
// of X. One thread per channel; channels are independent, so the state update needs no barrier.
kernel void deltanet_conv(device const float*         qkv   [[buffer(0)]],   // [S, C]
                     device const float*         cw    [[buffer(1)]],   // [C, K]
                     device float*               cst   [[buffer(2)]],   // [K-1, C] in/out
                     device float*               u     [[buffer(3)]],   // [S, C]
                     constant kp::DeltaNetParams& p    [[buffer(4)]],
                     uint c [[thread_position_in_grid]])
{
    const uint C = uint(p.conv_dim), K = uint(p.conv_kernel), S = uint(p.S);
    if (c >= C) return;
    for (uint t = 0; t < S; t++) {
        float acc = 0.0f;
        for (uint j = 0; j < K; j++) {
            const uint i = t + j;
            acc += cw[c * K + j] * (i < K - 1 ? cst[i * C + c] : qkv[ulong(i - (K - 1)) * C + c]);
        }
        u[ulong(t) * C + c] = silu(acc);
    }
    // ascending r: row S + r > r is read before it could be overwritten
    for (uint r = 0; r + 1 < K; r++) {
        const uint i = S + r;
        cst[r * C + c] = i < K - 1 ? cst[i * C + c] : qkv[ulong(i - (K - 1)) * C + c];
    }
}

// The recurrence for all S rows of the chunk. Threadgroup (x, h): NSG simdgroups, simdgroup s owns the
// ROWS state rows dv = (x*NSG + s)*ROWS + i; lane l holds elements dk = l + 32j (j < NK, Dk <= 32*NK).
// q/k l2-normalisation and the gates are computed in place; the state is read once and written once.
// FUSE: the threadgroup covers the whole head (x == 0, NSG*ROWS >= Dv), and the gated RMSNorm over Dv
// is applied per token through threadgroup memory (one barrier per token), writing y instead of o.
template <int NK, int ROWS, bool FUSE>
kernel void deltanet_scan(device const float*         u      [[buffer(0)]],   // [S, C]
                     device const float*         bb     [[buffer(1)]],   // [S, Hv] beta logits
                     device const float*         aa     [[buffer(2)]],   // [S, Hv] decay inputs
                     device const float*         a_log  [[buffer(3)]],   // [Hv]
                     device const float*         dt_b   [[buffer(4)]],   // [Hv]
                     device float*               state  [[buffer(5)]],   // [Hv, Dv, Dk] in/out
                     device float*               out    [[buffer(6)]],   // [S, Hv, Dv]
                     device const float*         z      [[buffer(7)]],   // [S, Hv, Dv] (FUSE)
                     device const float*         norm_w [[buffer(8)]],   // [Dv] (FUSE)
                     constant kp::DeltaNetParams& p     [[buffer(9)]],
                     uint2 tg   [[threadgroup_position_in_grid]],
                     uint  sg   [[simdgroup_index_in_threadgroup]],
                     uint  nsg  [[simdgroups_per_threadgroup]],
                     uint  lane [[thread_index_in_simdgroup]])
{
    threadgroup float tg_ss[2][32];
    const uint Hv = uint(p.v_heads), Dk = uint(p.k_dim), Dv = uint(p.v_dim), C = uint(p.conv_dim);
    const uint h = tg.y, kh = h / (Hv / uint(p.k_heads)), key_dim = uint(p.k_heads) * Dk;
    const uint dv0 = (tg.x * nsg + sg) * ROWS;
    const float q_scale = 1.0f / sqrt(float(Dk));
    const float A = exp(a_log[h]), dtb = dt_b[h];

    float r_st[ROWS][NK];
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < NK; j++) {
            const uint dv = dv0 + i, dk = lane + 32 * j;
            r_st[i][j] = (dv < Dv && dk < Dk) ? state[(ulong(h) * Dv + dv) * Dk + dk] : 0.0f;
        }
    for (uint t = 0; t < uint(p.S); t++) {
        device const float* ut = u + ulong(t) * C;
        float r_q[NK], r_k[NK], sq = 0.0f, sk = 0.0f;
        for (int j = 0; j < NK; j++) {
            const uint dk = lane + 32 * j;
            r_q[j] = dk < Dk ? ut[kh * Dk + dk] : 0.0f;
            r_k[j] = dk < Dk ? ut[key_dim + kh * Dk + dk] : 0.0f;
            sq += r_q[j] * r_q[j];
            sk += r_k[j] * r_k[j];
        }
        const float iq = 1.0f / sqrt(simd_sum(sq) + p.qk_eps) * q_scale, ik = 1.0f / sqrt(simd_sum(sk) + p.qk_eps);
        for (int j = 0; j < NK; j++) { r_q[j] *= iq; r_k[j] *= ik; }
        const float beta = sigmoid(bb[t * Hv + h]);
        const float g = exp(-A * softplus(aa[t * Hv + h] + dtb));
        float r_o[ROWS];
        for (int i = 0; i < ROWS; i++) {
            r_o[i] = 0.0f;
            const uint dv = dv0 + i;
            if (dv >= Dv) continue;   // uniform per simdgroup
            float m = 0.0f;
            for (int j = 0; j < NK; j++) { r_st[i][j] *= g; m += r_st[i][j] * r_k[j]; }
            const float delta = beta * (ut[2 * key_dim + h * Dv + dv] - simd_sum(m));
            float o = 0.0f;
            for (int j = 0; j < NK; j++) { r_st[i][j] += delta * r_k[j]; o += r_st[i][j] * r_q[j]; }
            r_o[i] = simd_sum(o);
        }
        device float* ot = out + (ulong(t) * Hv + h) * Dv;
        if (!FUSE) {
            for (int i = 0; i < ROWS; i++)
                if (lane == 0 && dv0 + i < Dv) ot[dv0 + i] = r_o[i];
            continue;
        }
        float ss = 0.0f;
        for (int i = 0; i < ROWS; i++) ss += r_o[i] * r_o[i];
        if (lane == 0) tg_ss[t & 1][sg] = ss;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float tot = 0.0f;
        for (uint s = 0; s < nsg; s++) tot += tg_ss[t & 1][s];
        const float inv = 1.0f / sqrt(tot / float(Dv) + p.norm_eps);
        device const float* zt = z + (ulong(t) * Hv + h) * Dv;
        for (int i = 0; i < ROWS; i++) {
            const uint dv = dv0 + i;
            if (lane == uint(i) && dv < Dv) ot[dv] = r_o[i] * inv * norm_w[dv] * silu(zt[dv]);
        }
    }
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < NK; j++) {
            const uint dv = dv0 + i, dk = lane + 32 * j;
            if (dv < Dv && dk < Dk) state[(ulong(h) * Dv + dv) * Dk + dk] = r_st[i][j];
        }
}

// y[t, h, :] = RMSNorm(o[t, h, :]; w) * silu(z[t, h, :]) in place (the unfused form). One simdgroup per (t, h).
kernel void deltanet_gated_norm(device float*               y  [[buffer(0)]],   // [S, Hv, Dv] in/out
                           device const float*         z  [[buffer(1)]],   // [S, Hv, Dv]
                           device const float*         w  [[buffer(2)]],   // [Dv]
                           constant kp::DeltaNetParams& p [[buffer(3)]],
                           uint th   [[threadgroup_position_in_grid]],
                           uint lane [[thread_index_in_simdgroup]])
{
    const uint Dv = uint(p.v_dim);
    device float* o = y + ulong(th) * Dv;
    device const float* zz = z + ulong(th) * Dv;
    float ss = 0.0f;
    for (uint i = lane; i < Dv; i += 32) ss += o[i] * o[i];
    const float inv = 1.0f / sqrt(simd_sum(ss) / float(Dv) + p.norm_eps);
    for (uint i = lane; i < Dv; i += 32) o[i] = o[i] * inv * w[i] * silu(zz[i]);
}

template [[host_name("deltanet_scan_nk1")]] [[kernel]] decltype(deltanet_scan<1, 4, false>) deltanet_scan<1, 4, false>;
template [[host_name("deltanet_scan_nk2")]] [[kernel]] decltype(deltanet_scan<2, 4, false>) deltanet_scan<2, 4, false>;
template [[host_name("deltanet_scan_nk4")]] [[kernel]] decltype(deltanet_scan<4, 4, false>) deltanet_scan<4, 4, false>;
template [[host_name("deltanet_scan_norm_nk1")]] [[kernel]] decltype(deltanet_scan<1, 4, true>) deltanet_scan<1, 4, true>;
template [[host_name("deltanet_scan_norm_nk2")]] [[kernel]] decltype(deltanet_scan<2, 4, true>) deltanet_scan<2, 4, true>;
template [[host_name("deltanet_scan_norm_nk4")]] [[kernel]] decltype(deltanet_scan<4, 4, true>) deltanet_scan<4, 4, true>;
