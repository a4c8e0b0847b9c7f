// Gated full attention (docs/model.md §4.2; docs/metal.md, Kernels: attention).
// attn_prep: per (row, head) q/k RMSNorm, partial half-split RoPE, K/V append to the cache.
// attn_prefill: causal attention over the cache; one simdgroup per query row, the HPG query heads of a
//   KV head packed in the same simdgroup so every K/V row load serves all of them (GQA packing).
// attn_decode + attn_decode_combine: split-K over fixed-size key blocks, one partial (m, l, o) per
//   simdgroup, merged per query head, output gate applied in the combine.
// Layouts: qg [S, Hq, 2D] (per head [query | gate]); k, v [S, Hkv*D]; cache [capacity, Hkv*D] fp32, or
// bf16 (kernels named *_kvbf16);
// q [S, Hq, D]; out [S, Hq*D]. Lane l holds dims d = l + 32j, j < ND (D = 32*ND).
#include "common.h"

// RoPE angle pos * f reduced to [-pi, pi] without losing the low bits a float product of a large
// position would drop: f = hi + lo (host table, from double); 2*pi split Cody-Waite style (8-bit C1, C2).
inline float rope_angle(float pos, float hi, float lo) {
    const float p = pos * hi;
    const float e = fma(pos, hi, -p) + pos * lo;          // exact low part of pos * hi, plus pos * lo
    const float k = rint(p * 0.15915494309189535f);
    float r = fma(-k, 6.28125f, p);                        // exact: k < 2^16, C1 has 8 significant bits
    r = fma(-k, 0.00193023681640625f, r);                  // exact: C2 has 8 significant bits
    r = fma(-k, 5.070363386039389e-06f, r);                // C3 = 2*pi - C1 - C2
    return r + e;
}

// One simdgroup per (row t, head): heads [0, Hq) are query heads (written to q), [Hq, Hq+Hkv) KV heads
// (normed + roped K and raw V appended at cache row pos0 + t). rope: [rotary_dim/2][2] (hi, lo) freqs.
// KVT: cache element (float, or ushort holding bf16).
template <int ND, typename KVT>
kernel void attn_prep(device const float*          qg      [[buffer(0)]],   // [S, Hq*2D]
                      device const float*          kin     [[buffer(1)]],   // [S, Hkv*D]
                      device const float*          vin     [[buffer(2)]],   // [S, Hkv*D]
                      device const float*          q_norm  [[buffer(3)]],   // [D]
                      device const float*          k_norm  [[buffer(4)]],   // [D]
                      device const float*          rope    [[buffer(5)]],   // [rd/2, 2]
                      device float*                q       [[buffer(6)]],   // [S, Hq*D]
                      device KVT*                  k_cache [[buffer(7)]],   // [cap, Hkv*D]
                      device KVT*                  v_cache [[buffer(8)]],   // [cap, Hkv*D]
                      constant kp::AttentionParams& p      [[buffer(9)]],
                      uint2 tg   [[threadgroup_position_in_grid]],
                      uint  lane [[thread_index_in_simdgroup]])
{
    const uint D = uint(p.head_dim), Hq = uint(p.n_heads), Hkv = uint(p.n_kv_heads), t = tg.x, hh = tg.y;
    const bool is_q = hh < Hq;
    const uint kvh = hh - Hq;
    const ulong kv_row = ulong(Hkv) * D, cache_row = ulong(p.pos0) + t;
    device const float* src = is_q ? qg + (ulong(t) * Hq + hh) * 2 * D : kin + t * kv_row + kvh * D;
    device const float* w = is_q ? q_norm : k_norm;
    device float* qdst = q + (ulong(t) * Hq + hh) * D;
    const ulong kbase = cache_row * kv_row + kvh * D;
    float ss = 0.0f;
    for (int j = 0; j < ND; j++) { const float x = src[lane + 32 * j]; ss += x * x; }
    const float inv = 1.0f / sqrt(simd_sum(ss) / float(D) + p.eps);
    const uint half_rd = uint(p.rotary_dim) / 2;
    const float pos = float(p.pos0 + long(t));
    for (int j = 0; j < ND; j++) {
        const uint d = lane + 32 * j;
        float x = src[d] * inv * w[d];
        if (d < 2 * half_rd) {
            const uint i = d % half_rd, pd = d < half_rd ? d + half_rd : d - half_rd;
            const float a = rope_angle(pos, rope[2 * i], rope[2 * i + 1]);
            const float xp = src[pd] * inv * w[pd];
            x = d < half_rd ? x * cos(a) - xp * sin(a) : x * cos(a) + xp * sin(a);
        }
        if (is_q) qdst[d] = x;
        else kv_io<KVT>::store(k_cache, kbase + d, x);
    }
    if (!is_q)
        for (int j = 0; j < ND; j++) {
            const uint d = lane + 32 * j;
            kv_io<KVT>::store(v_cache, kbase + d, vin[t * kv_row + kvh * D + d]);
        }
}

// Online-softmax update of HPG heads with key row kr / value row vr (lane's ND dims of each).
template <int ND, int HPG, typename KVT>
inline void attend_key(device const KVT* kr, device const KVT* vr, const thread float (&r_q)[HPG][ND],
                       thread float (&r_o)[HPG][ND], thread float (&m)[HPG], thread float (&l)[HPG], uint lane) {
    float kv[ND], vv[ND];
    for (int j = 0; j < ND; j++) {
        kv[j] = kv_io<KVT>::load(kr, lane + 32 * j);
        vv[j] = kv_io<KVT>::load(vr, lane + 32 * j);
    }
    for (int h = 0; h < HPG; h++) {
        float part = 0.0f;
        for (int j = 0; j < ND; j++) part += r_q[h][j] * kv[j];
        const float s = simd_sum(part);
        const float mn = max(m[h], s);
        const float corr = exp(m[h] - mn), pr = exp(s - mn);
        l[h] = l[h] * corr + pr;
        m[h] = mn;
        for (int j = 0; j < ND; j++) r_o[h][j] = r_o[h][j] * corr + pr * vv[j];
    }
}

// Grid (ceil(S / R), Hkv, ceil(G / HPG)), R simdgroups; simdgroup s = query row t = x*R + s, query heads
// kvh*G + z*HPG + i. Keys 0 .. pos0 + t (causal), read straight from the cache (rows shared in cache
// by the R rows and HPG heads of the threadgroup).
template <int ND, int HPG, typename KVT>
kernel void attn_prefill(device const float*          q       [[buffer(0)]],   // [S, Hq*D]
                         device const float*          qg      [[buffer(1)]],   // [S, Hq*2D] (gate half)
                         device const KVT*            k_cache [[buffer(2)]],
                         device const KVT*            v_cache [[buffer(3)]],
                         device float*                out     [[buffer(4)]],   // [S, Hq*D]
                         constant kp::AttentionParams& p      [[buffer(5)]],
                         uint3 tg   [[threadgroup_position_in_grid]],
                         uint  sg   [[simdgroup_index_in_threadgroup]],
                         uint  nsg  [[simdgroups_per_threadgroup]],
                         uint  lane [[thread_index_in_simdgroup]])
{
    const uint D = uint(p.head_dim), Hq = uint(p.n_heads), Hkv = uint(p.n_kv_heads), G = Hq / Hkv;
    const uint t = tg.x * nsg + sg, kvh = tg.y, g0 = tg.z * HPG;
    if (t >= uint(p.S)) return;   // whole simdgroup; no threadgroup barrier in this kernel
    const ulong kv_row = ulong(Hkv) * D;
    float r_q[HPG][ND], r_o[HPG][ND], m[HPG], l[HPG];
    for (int h = 0; h < HPG; h++) {
        const uint hq = kvh * G + g0 + h;
        const bool ok = g0 + h < G;
        for (int j = 0; j < ND; j++) {
            r_q[h][j] = ok ? q[(ulong(t) * Hq + hq) * D + lane + 32 * j] * p.scale : 0.0f;
            r_o[h][j] = 0.0f;
        }
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    const ulong last = ulong(p.pos0) + t;
    for (ulong key = 0; key <= last; key++)
        attend_key<ND, HPG, KVT>(k_cache + key * kv_row + kvh * D, v_cache + key * kv_row + kvh * D, r_q, r_o, m, l, lane);
    for (int h = 0; h < HPG; h++) {
        const uint hq = kvh * G + g0 + h;
        if (g0 + h >= G) continue;
        for (int j = 0; j < ND; j++) {
            const uint d = lane + 32 * j;
            const float gate = qg[(ulong(t) * Hq + hq) * 2 * D + D + d];
            out[(ulong(t) * Hq + hq) * D + d] = r_o[h][j] / l[h] * sigmoid(gate);
        }
    }
}

// Decode, split-K: grid (n_blocks, Hkv, ceil(G / HPG)), NSG simdgroups; part = block*NSG + s covers keys
// [part*L, min(T, part*L + L)) with L = split_len, T = pos0 + 1. Partials: ml [Hq, n_splits, 2] (m, l),
// po [Hq, n_splits, D]; an empty part stores m = -inf, l = 0.
template <int ND, int HPG, typename KVT>
kernel void attn_decode(device const float*          q       [[buffer(0)]],   // [Hq*D]
                        device const KVT*            k_cache [[buffer(1)]],
                        device const KVT*            v_cache [[buffer(2)]],
                        device float*                ml      [[buffer(3)]],
                        device float*                po      [[buffer(4)]],
                        constant kp::AttentionParams& p      [[buffer(5)]],
                        constant kp::AttnSplitParams& sp     [[buffer(6)]],
                        uint3 tg   [[threadgroup_position_in_grid]],
                        uint  sg   [[simdgroup_index_in_threadgroup]],
                        uint  nsg  [[simdgroups_per_threadgroup]],
                        uint  lane [[thread_index_in_simdgroup]])
{
    const uint D = uint(p.head_dim), Hq = uint(p.n_heads), Hkv = uint(p.n_kv_heads), G = Hq / Hkv;
    const uint part = tg.x * nsg + sg, kvh = tg.y, g0 = tg.z * HPG, NS = uint(sp.n_splits);
    if (part >= NS) return;   // whole simdgroup
    const ulong kv_row = ulong(Hkv) * D, T = ulong(p.pos0) + 1;
    float r_q[HPG][ND], r_o[HPG][ND], m[HPG], l[HPG];
    for (int h = 0; h < HPG; h++) {
        const bool ok = g0 + h < G;
        for (int j = 0; j < ND; j++) {
            r_q[h][j] = ok ? q[ulong(kvh * G + g0 + h) * D + lane + 32 * j] * p.scale : 0.0f;
            r_o[h][j] = 0.0f;
        }
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    const ulong k0 = ulong(part) * ulong(sp.split_len), k1 = min(T, k0 + ulong(sp.split_len));
    for (ulong key = k0; key < k1; key++)
        attend_key<ND, HPG, KVT>(k_cache + key * kv_row + kvh * D, v_cache + key * kv_row + kvh * D, r_q, r_o, m, l, lane);
    for (int h = 0; h < HPG; h++) {
        if (g0 + h >= G) continue;
        const ulong slot = ulong(kvh * G + g0 + h) * NS + part;
        if (lane == 0) { ml[2 * slot] = m[h]; ml[2 * slot + 1] = l[h]; }
        for (int j = 0; j < ND; j++) po[slot * D + lane + 32 * j] = r_o[h][j];
    }
}

// out[h, :] = (sum_p e^(m_p - M) o_p) / (sum_p e^(m_p - M) l_p) * sigmoid(gate[h, :]). One simdgroup per head.
template <int ND>
kernel void attn_decode_combine(device const float*          ml  [[buffer(0)]],
                                device const float*          po  [[buffer(1)]],
                                device const float*          qg  [[buffer(2)]],   // [Hq*2D] (gate half)
                                device float*                out [[buffer(3)]],   // [Hq*D]
                                constant kp::AttentionParams& p  [[buffer(4)]],
                                constant kp::AttnSplitParams& sp [[buffer(5)]],
                                uint h    [[threadgroup_position_in_grid]],
                                uint lane [[thread_index_in_simdgroup]])
{
    const uint D = uint(p.head_dim), NS = uint(sp.n_splits);
    float M = -INFINITY;
    for (uint s = 0; s < NS; s++) M = max(M, ml[2 * (ulong(h) * NS + s)]);
    float L = 0.0f, r_o[ND];
    for (int j = 0; j < ND; j++) r_o[j] = 0.0f;
    for (uint s = 0; s < NS; s++) {
        const ulong slot = ulong(h) * NS + s;
        const float c = ml[2 * slot + 1] > 0.0f ? exp(ml[2 * slot] - M) : 0.0f;
        L += c * ml[2 * slot + 1];
        for (int j = 0; j < ND; j++) r_o[j] += c * po[slot * D + lane + 32 * j];
    }
    for (int j = 0; j < ND; j++) {
        const uint d = lane + 32 * j;
        out[ulong(h) * D + d] = r_o[j] / L * sigmoid(qg[ulong(h) * 2 * D + D + d]);
    }
}

template [[host_name("attn_prep_nd1")]] [[kernel]] decltype(attn_prep<1, float>) attn_prep<1, float>;
template [[host_name("attn_prep_nd1_kvbf16")]] [[kernel]] decltype(attn_prep<1, ushort>) attn_prep<1, ushort>;
template [[host_name("attn_prep_nd2")]] [[kernel]] decltype(attn_prep<2, float>) attn_prep<2, float>;
template [[host_name("attn_prep_nd2_kvbf16")]] [[kernel]] decltype(attn_prep<2, ushort>) attn_prep<2, ushort>;
template [[host_name("attn_prep_nd8")]] [[kernel]] decltype(attn_prep<8, float>) attn_prep<8, float>;
template [[host_name("attn_prep_nd8_kvbf16")]] [[kernel]] decltype(attn_prep<8, ushort>) attn_prep<8, ushort>;
template [[host_name("attn_prefill_nd1_h4")]] [[kernel]] decltype(attn_prefill<1, 4, float>) attn_prefill<1, 4, float>;
template [[host_name("attn_prefill_nd1_h4_kvbf16")]] [[kernel]] decltype(attn_prefill<1, 4, ushort>) attn_prefill<1, 4, ushort>;
template [[host_name("attn_prefill_nd2_h4")]] [[kernel]] decltype(attn_prefill<2, 4, float>) attn_prefill<2, 4, float>;
template [[host_name("attn_prefill_nd2_h4_kvbf16")]] [[kernel]] decltype(attn_prefill<2, 4, ushort>) attn_prefill<2, 4, ushort>;
template [[host_name("attn_prefill_nd8_h8")]] [[kernel]] decltype(attn_prefill<8, 8, float>) attn_prefill<8, 8, float>;
template [[host_name("attn_prefill_nd8_h8_kvbf16")]] [[kernel]] decltype(attn_prefill<8, 8, ushort>) attn_prefill<8, 8, ushort>;
template [[host_name("attn_decode_nd1_h4")]] [[kernel]] decltype(attn_decode<1, 4, float>) attn_decode<1, 4, float>;
template [[host_name("attn_decode_nd1_h4_kvbf16")]] [[kernel]] decltype(attn_decode<1, 4, ushort>) attn_decode<1, 4, ushort>;
template [[host_name("attn_decode_nd2_h4")]] [[kernel]] decltype(attn_decode<2, 4, float>) attn_decode<2, 4, float>;
template [[host_name("attn_decode_nd2_h4_kvbf16")]] [[kernel]] decltype(attn_decode<2, 4, ushort>) attn_decode<2, 4, ushort>;
template [[host_name("attn_decode_nd8_h8")]] [[kernel]] decltype(attn_decode<8, 8, float>) attn_decode<8, 8, float>;
template [[host_name("attn_decode_nd8_h8_kvbf16")]] [[kernel]] decltype(attn_decode<8, 8, ushort>) attn_decode<8, 8, ushort>;
template [[host_name("attn_decode_combine_nd1")]] [[kernel]] decltype(attn_decode_combine<1>) attn_decode_combine<1>;
template [[host_name("attn_decode_combine_nd2")]] [[kernel]] decltype(attn_decode_combine<2>) attn_decode_combine<2>;
template [[host_name("attn_decode_combine_nd8")]] [[kernel]] decltype(attn_decode_combine<8>) attn_decode_combine<8>;
