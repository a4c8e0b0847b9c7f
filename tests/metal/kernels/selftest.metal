// Kernels that exercise the emulator itself (tests/metal/test_toolchain.py), not lily kernels.
#include <metal_stdlib>
#include "kernels/params.h"
using namespace metal;

constant bool fc_double_it [[function_constant(0)]];
constant uint fc_offset [[function_constant(1)]];

// Per thread, 8 values: butterfly sum (shuffle_xor), exclusive prefix sum, broadcast of lane 5,
// simd_max, shuffle_down(1), simd_shuffle(31 - lane), simd_min, inclusive prefix sum.
kernel void simd_ops(device const float* in  [[buffer(0)]],
                     device float*       out [[buffer(1)]],
                     uint   gid  [[thread_position_in_grid]],
                     ushort lane [[thread_index_in_simdgroup]])
{
    const float v = in[gid];
    float b = v;
    for (ushort m = 16; m > 0; m >>= 1) b += simd_shuffle_xor(b, m);
    out[gid * 8 + 0] = b;
    out[gid * 8 + 1] = simd_prefix_exclusive_sum(v);
    out[gid * 8 + 2] = simd_broadcast(v, ushort(5));
    out[gid * 8 + 3] = simd_max(v);
    const float d = simd_shuffle_down(v, ushort(1));
    out[gid * 8 + 4] = lane < 31 ? d : v;
    out[gid * 8 + 5] = simd_shuffle(v, ushort(31 - lane));
    out[gid * 8 + 6] = simd_min(v);
    out[gid * 8 + 7] = simd_prefix_inclusive_sum(v);
}

// C = A * B with 8x8 simdgroup matrices: one simdgroup per 8x8 output tile, 2x2 tiles per threadgroup.
template <typename T>
kernel void sg_matmul(device const float* A [[buffer(0)]],     // [M, K]
                      device const float* B [[buffer(1)]],     // [K, N]
                      device float*       C [[buffer(2)]],     // [M, N]
                      constant uint3&     mnk [[buffer(3)]],
                      uint2  tg   [[threadgroup_position_in_grid]],
                      uint   sgid [[simdgroup_index_in_threadgroup]],
                      uint   tid  [[thread_index_in_threadgroup]])
{
    threadgroup T tg_a[16 * 8];
    const uint N = mnk.y, K = mnk.z;
    const uint row = tg.y * 16 + (sgid / 2) * 8, col = tg.x * 16 + (sgid % 2) * 8;
    simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint k = 0; k < K; k += 8) {
        for (uint i = tid; i < 16 * 8; i += 128) tg_a[i] = T(A[(tg.y * 16 + i / 8) * K + k + i % 8]);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_matrix<T, 8, 8> a;
        simdgroup_matrix<float, 8, 8> b;
        simdgroup_load(a, tg_a + (sgid / 2) * 64, 8);
        simdgroup_load(b, B + k * N + col, N);
        simdgroup_multiply_accumulate(acc, a, b, acc);
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    simdgroup_store(acc, C + row * N + col, N);
}

template [[host_name("sg_matmul_f32")]] [[kernel]] decltype(sg_matmul<float>) sg_matmul<float>;
template [[host_name("sg_matmul_f16")]] [[kernel]] decltype(sg_matmul<half>) sg_matmul<half>;

// Reverses each threadgroup's slice through threadgroup memory; exercises barriers, params structs and
// function constants: out[i] = in[mirror(i)] * (fc_double_it ? 2 : 1) + fc_offset + p.n_heads.
kernel void tg_reverse(device const float*              in  [[buffer(0)]],
                       device float*                    out [[buffer(1)]],
                       constant lily::kp::AttentionParams& p [[buffer(2)]],
                       uint tid [[thread_index_in_threadgroup]],
                       uint tpg [[threads_per_threadgroup]],
                       uint gid [[thread_position_in_grid]])
{
    threadgroup float tg_buf[1024];
    tg_buf[tid] = in[gid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float v = tg_buf[tpg - 1 - tid];
    if (fc_double_it) v *= 2.0f;
    out[gid] = v + float(fc_offset) + float(p.n_heads) + float(p.pos0);
}

// Reads in[gid + shift]: with shift > 0 the last threads read past the end of the buffer.
kernel void shifted_copy(device const float* in  [[buffer(0)]],
                         device float*       out [[buffer(1)]],
                         constant int&       shift [[buffer(2)]],
                         uint gid [[thread_position_in_grid]])
{
    out[gid] = in[int(gid) + shift];
}

// Negative cases for the emulator's own checks (each must be reported).
kernel void divergent_sum(device const float* in  [[buffer(0)]],
                          device float*       out [[buffer(1)]],
                          uint gid  [[thread_position_in_grid]],
                          uint lane [[thread_index_in_simdgroup]])
{
    float v = in[gid];
    if (lane < 16) v = simd_sum(v);   // half of the simdgroup: undefined for the other half's view
    out[gid] = v;
}

kernel void tg_too_big(device float* out [[buffer(0)]],
                       uint tid [[thread_index_in_threadgroup]])
{
    threadgroup float tg_big[9000];   // 36 KB > 32 KB
    tg_big[tid] = float(tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = tg_big[tid];
}

// Writes through a cast-away-const pointer into a `device const` input.
kernel void write_input(device float* out [[buffer(0)]],
                        device const float* in [[buffer(1)]],
                        uint gid [[thread_position_in_grid]])
{
    out[gid] = in[gid] + 1.0f;
    ((device float*)in)[gid] = 0.0f;
}

kernel void read_unwritten_tg(device float* out [[buffer(0)]],
                              uint tid [[thread_index_in_threadgroup]])
{
    threadgroup float tg_part[64];
    if (tid < 32) tg_part[tid] = 1.0f;   // upper half never written: reads see the NaN poison
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[tid] = tg_part[63 - tid];
}
