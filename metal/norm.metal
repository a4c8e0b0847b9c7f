// Row-wise kernels: RMSNorm, embedding lookup (one dequantized row per token), greedy token selection.
#include "common.h"

// y[s, :] = x[s, :] * rsqrt(mean(x[s, :]^2) + eps) * w. One threadgroup per row (<= 32 simdgroups).
kernel void rms_norm(device const float*   x  [[buffer(0)]],
                     device const float*   w  [[buffer(1)]],
                     device float*         y  [[buffer(2)]],
                     constant kp::NormArgs& na [[buffer(3)]],
                     uint s    [[threadgroup_position_in_grid]],
                     uint tid  [[thread_index_in_threadgroup]],
                     uint nt   [[threads_per_threadgroup]],
                     uint sg   [[simdgroup_index_in_threadgroup]],
                     uint nsg  [[simdgroups_per_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]])
{
    threadgroup float tg_part[32];
    const uint n = uint(na.dim);
    device const float* xr = x + ulong(s) * ulong(na.x_stride);
    float ss = 0.0f;
    for (uint i = tid; i < n; i += nt) ss += xr[i] * xr[i];
    ss = simd_sum(ss);
    if (lane == 0) tg_part[sg] = ss;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float tot = 0.0f;
    for (uint i = 0; i < nsg; i++) tot += tg_part[i];
    const float inv = 1.0f / sqrt(tot / float(n) + na.eps);
    device float* yr = y + ulong(s) * ulong(na.y_stride);
    for (uint i = tid; i < n; i += nt) yr[i] = xr[i] * inv * w[i];
}

// x[s, :] = E[ids[s], :] dequantized. One threadgroup per token.
template <int WF>
kernel void embed(device const uchar*      w   [[buffer(0)]],
                  device const ushort*     ws  [[buffer(1)]],
                  device const ushort*     wb  [[buffer(2)]],
                  device const int*        ids [[buffer(3)]],   // [S]
                  device float*            x   [[buffer(4)]],   // [S, H]
                  constant kp::LinearParams& la  [[buffer(5)]],
                  uint s   [[threadgroup_position_in_grid]],
                  uint tid [[thread_index_in_threadgroup]],
                  uint nt  [[threads_per_threadgroup]])
{
    const WRef r{w, ws, wb};
    const uint H = uint(la.in), row = uint(ids[s]);
    for (uint i = tid; i < H; i += nt) x[ulong(s) * H + i] = w_at<WF>(r, row, i, la);
}

// tokens[slot] = argmax(logits[0, :V]) (lowest index on ties): greedy sampling on the device, so the
// decode loop feeds the next step without a host round trip. One threadgroup.
kernel void argmax(device const float*   logits [[buffer(0)]],
                   device int*           tokens [[buffer(1)]],
                   constant kp::NormArgs& na    [[buffer(2)]],   // dim = V, x_stride = slot
                   uint tid  [[thread_index_in_threadgroup]],
                   uint nt   [[threads_per_threadgroup]],
                   uint sg   [[simdgroup_index_in_threadgroup]],
                   uint nsg  [[simdgroups_per_threadgroup]],
                   uint lane [[thread_index_in_simdgroup]])
{
    threadgroup float tg_v[32];
    threadgroup uint tg_i[32];
    float best = -INFINITY;
    uint bi = 0xffffffffu;
    for (uint i = tid; i < uint(na.dim); i += nt)
        if (logits[i] > best) { best = logits[i]; bi = i; }
    float top = simd_max(best);
    uint ti = simd_min(best == top ? bi : 0xffffffffu);
    if (lane == 0) { tg_v[sg] = top; tg_i[sg] = ti; }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
        for (uint i = 1; i < nsg; i++)
            if (tg_v[i] > top || (tg_v[i] == top && tg_i[i] < ti)) { top = tg_v[i]; ti = tg_i[i]; }
        tokens[na.x_stride] = int(ti);
    }
}

template [[host_name("embed_q4")]] [[kernel]] decltype(embed<WF_Q4>) embed<WF_Q4>;
template [[host_name("embed_q8")]] [[kernel]] decltype(embed<WF_Q8>) embed<WF_Q8>;
template [[host_name("embed_bf16")]] [[kernel]] decltype(embed<WF_BF16>) embed<WF_BF16>;
template [[host_name("embed_f32")]] [[kernel]] decltype(embed<WF_F32>) embed<WF_F32>;
