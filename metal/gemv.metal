// Row-parallel GEMV for decode (docs/metal.md, Kernels: GEMV): y[s, r] (+)= dot(W[r, :], x[s, :]).
// A simdgroup owns ROWS output rows; its 32 lanes stride over 16-byte chunks of each row (coalesced),
// dequantize in registers (s*dot(q, x) + b*sum(x) per group) and reduce with simd_sum. The x chunk is
// loaded once and reused for the ROWS rows. Grid: (ceil(out / (ROWS*NSG)), S); NSG simdgroups per group.
#include "common.h"

template <int WF, int ROWS>
kernel void gemv(device const uchar*          w   [[buffer(0)]],   // codes or dense [out, in]
                 device const ushort*         ws  [[buffer(1)]],   // scales [out, in/group] (quantized)
                 device const ushort*         wb  [[buffer(2)]],   // biases [out, in/group] (quantized)
                 device const float*          x   [[buffer(3)]],   // [S, x_stride]
                 device float*                y   [[buffer(4)]],   // [S, y_stride]
                 constant kp::LinearParams&     la  [[buffer(5)]],
                 constant kp::GemvArgs&       ga  [[buffer(6)]],
                 uint2 tg   [[threadgroup_position_in_grid]],
                 uint  sg   [[simdgroup_index_in_threadgroup]],
                 uint  nsg  [[simdgroups_per_threadgroup]],
                 uint  lane [[thread_index_in_simdgroup]])
{
    constexpr int VPC = wf_vpc(WF);
    const WRef r{w, ws, wb};
    const uint row0 = (tg.x * nsg + sg) * ROWS;
    const uint out = uint(la.out);
    device const float* xs = x + ulong(tg.y) * ulong(ga.x_stride);
    const uint nchunks = uint(la.in) / VPC;
    float acc[ROWS];
    for (int i = 0; i < ROWS; i++) acc[i] = 0.0f;
    for (uint c = lane; c < nchunks; c += 32) {
        float xv[VPC];
        const float xsum = load_x_chunk<WF>(xs, c, xv);
        for (int i = 0; i < ROWS; i++)
            if (row0 + i < out) acc[i] += chunk_dot<WF>(r, row0 + i, c, xv, xsum, la);
    }
    device float* ys = y + ulong(tg.y) * ulong(ga.y_stride);
    for (int i = 0; i < ROWS; i++) {
        const float v = simd_sum(acc[i]);
        if (lane == 0 && row0 + i < out) ys[row0 + i] = ga.accumulate ? ys[row0 + i] + v : v;
    }
}

template [[host_name("gemv_q4")]] [[kernel]] decltype(gemv<WF_Q4, 4>) gemv<WF_Q4, 4>;
template [[host_name("gemv_q8")]] [[kernel]] decltype(gemv<WF_Q8, 4>) gemv<WF_Q8, 4>;
template [[host_name("gemv_bf16")]] [[kernel]] decltype(gemv<WF_BF16, 4>) gemv<WF_BF16, 4>;
template [[host_name("gemv_f32")]] [[kernel]] decltype(gemv<WF_F32, 4>) gemv<WF_F32, 4>;
