// Row-parallel GEMV for decode (docs/metal.md, Kernels: GEMV): y[s, r] (+)= dot(W[r, :], x[s, :]) for NM input rows s
// per threadgroup (a decode step: NM = 1; a speculative verify or a batch of streams: up to 8), so each weight chunk
// is read and dequantized once for all of them. A simdgroup owns ROWS output rows; its 32 lanes stride over 16-byte
// chunks of each row (coalesced), dequantize in registers (s*dot(q, x) + b*sum(x) per group) and reduce with
// simd_sum. Input row s sees the operations of the one-row kernel in its order (lane l: chunks l, l + 32, ...;
// frag_dot; simd_sum), so its result is bit-equal to an NM = 1 launch on that row alone.
// Grid: (ceil(out / (ROWS*NSG)), S / NM); NSG simdgroups per threadgroup; S a multiple of NM (Ops::linear).
#include "common.h"

template <int WF, int ROWS, int NM>
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
    constexpr bool HOLD = x_hold(WF, NM);
    const WRef r{w, ws, wb};
    const uint row0 = (tg.x * nsg + sg) * ROWS;
    const uint out = uint(la.out);
    device const float* xs = x + ulong(tg.y) * NM * ulong(ga.x_stride);   // this threadgroup's NM rows
    const uint nchunks = uint(la.in) / VPC;
    float accs[NM][ROWS];
    for (int m = 0; m < NM; m++)
        for (int i = 0; i < ROWS; i++) accs[m][i] = 0.0f;
    for (uint c = lane; c < nchunks; c += 32) {
        float xsum[NM], xh[HOLD ? NM : 1][VPC];
        for (int m = 0; m < NM; m++) xsum[m] = load_x_chunk<WF>(xs + m * ulong(ga.x_stride), c, xh[HOLD ? m : 0]);
        for (int i = 0; i < ROWS; i++) {
            if (row0 + i >= out) continue;
            const WFrag<WF> f = w_frag<WF>(r, row0 + i, c, la);
            for (int m = 0; m < NM; m++) {
                float xv[VPC];
                if (!HOLD) load_x_chunk<WF>(xs + m * ulong(ga.x_stride), c, xv);
                accs[m][i] += frag_dot<WF>(f, HOLD ? xh[m] : xv, xsum[m]);
            }
        }
    }
    for (int m = 0; m < NM; m++) {
        const thread float* acc = accs[m];
        device float* ys = y + (ulong(tg.y) * NM + m) * ulong(ga.y_stride);
        for (int i = 0; i < ROWS; i++) {
            const float v = simd_sum(acc[i]);
            if (lane == 0 && row0 + i < out) ys[row0 + i] = ga.accumulate ? ys[row0 + i] + v : v;
        }
    }
}

// gemv_<fmt>: one input row per threadgroup (decode); gemv_<fmt>_m<NM>: NM rows (Ops::linear, exact rows).
template [[host_name("gemv_q4")]] [[kernel]] decltype(gemv<WF_Q4, 4, 1>) gemv<WF_Q4, 4, 1>;
template [[host_name("gemv_q4_m2")]] [[kernel]] decltype(gemv<WF_Q4, 4, 2>) gemv<WF_Q4, 4, 2>;
template [[host_name("gemv_q4_m3")]] [[kernel]] decltype(gemv<WF_Q4, 4, 3>) gemv<WF_Q4, 4, 3>;
template [[host_name("gemv_q4_m4")]] [[kernel]] decltype(gemv<WF_Q4, 4, 4>) gemv<WF_Q4, 4, 4>;
template [[host_name("gemv_q4_m5")]] [[kernel]] decltype(gemv<WF_Q4, 4, 5>) gemv<WF_Q4, 4, 5>;
template [[host_name("gemv_q4_m6")]] [[kernel]] decltype(gemv<WF_Q4, 4, 6>) gemv<WF_Q4, 4, 6>;
template [[host_name("gemv_q4_m7")]] [[kernel]] decltype(gemv<WF_Q4, 4, 7>) gemv<WF_Q4, 4, 7>;
template [[host_name("gemv_q4_m8")]] [[kernel]] decltype(gemv<WF_Q4, 4, 8>) gemv<WF_Q4, 4, 8>;
template [[host_name("gemv_q8")]] [[kernel]] decltype(gemv<WF_Q8, 4, 1>) gemv<WF_Q8, 4, 1>;
template [[host_name("gemv_q8_m2")]] [[kernel]] decltype(gemv<WF_Q8, 4, 2>) gemv<WF_Q8, 4, 2>;
template [[host_name("gemv_q8_m3")]] [[kernel]] decltype(gemv<WF_Q8, 4, 3>) gemv<WF_Q8, 4, 3>;
template [[host_name("gemv_q8_m4")]] [[kernel]] decltype(gemv<WF_Q8, 4, 4>) gemv<WF_Q8, 4, 4>;
template [[host_name("gemv_q8_m5")]] [[kernel]] decltype(gemv<WF_Q8, 4, 5>) gemv<WF_Q8, 4, 5>;
template [[host_name("gemv_q8_m6")]] [[kernel]] decltype(gemv<WF_Q8, 4, 6>) gemv<WF_Q8, 4, 6>;
template [[host_name("gemv_q8_m7")]] [[kernel]] decltype(gemv<WF_Q8, 4, 7>) gemv<WF_Q8, 4, 7>;
template [[host_name("gemv_q8_m8")]] [[kernel]] decltype(gemv<WF_Q8, 4, 8>) gemv<WF_Q8, 4, 8>;
template [[host_name("gemv_bf16")]] [[kernel]] decltype(gemv<WF_BF16, 4, 1>) gemv<WF_BF16, 4, 1>;
template [[host_name("gemv_bf16_m2")]] [[kernel]] decltype(gemv<WF_BF16, 4, 2>) gemv<WF_BF16, 4, 2>;
template [[host_name("gemv_bf16_m3")]] [[kernel]] decltype(gemv<WF_BF16, 4, 3>) gemv<WF_BF16, 4, 3>;
template [[host_name("gemv_bf16_m4")]] [[kernel]] decltype(gemv<WF_BF16, 4, 4>) gemv<WF_BF16, 4, 4>;
template [[host_name("gemv_bf16_m5")]] [[kernel]] decltype(gemv<WF_BF16, 4, 5>) gemv<WF_BF16, 4, 5>;
template [[host_name("gemv_bf16_m6")]] [[kernel]] decltype(gemv<WF_BF16, 4, 6>) gemv<WF_BF16, 4, 6>;
template [[host_name("gemv_bf16_m7")]] [[kernel]] decltype(gemv<WF_BF16, 4, 7>) gemv<WF_BF16, 4, 7>;
template [[host_name("gemv_bf16_m8")]] [[kernel]] decltype(gemv<WF_BF16, 4, 8>) gemv<WF_BF16, 4, 8>;
template [[host_name("gemv_f32")]] [[kernel]] decltype(gemv<WF_F32, 4, 1>) gemv<WF_F32, 4, 1>;
template [[host_name("gemv_f32_m2")]] [[kernel]] decltype(gemv<WF_F32, 4, 2>) gemv<WF_F32, 4, 2>;
template [[host_name("gemv_f32_m3")]] [[kernel]] decltype(gemv<WF_F32, 4, 3>) gemv<WF_F32, 4, 3>;
template [[host_name("gemv_f32_m4")]] [[kernel]] decltype(gemv<WF_F32, 4, 4>) gemv<WF_F32, 4, 4>;
template [[host_name("gemv_f32_m5")]] [[kernel]] decltype(gemv<WF_F32, 4, 5>) gemv<WF_F32, 4, 5>;
template [[host_name("gemv_f32_m6")]] [[kernel]] decltype(gemv<WF_F32, 4, 6>) gemv<WF_F32, 4, 6>;
template [[host_name("gemv_f32_m7")]] [[kernel]] decltype(gemv<WF_F32, 4, 7>) gemv<WF_F32, 4, 7>;
template [[host_name("gemv_f32_m8")]] [[kernel]] decltype(gemv<WF_F32, 4, 8>) gemv<WF_F32, 4, 8>;
