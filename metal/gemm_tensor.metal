// Fused-dequant prefill GEMM on Metal 4 tensor ops (MetalPerformancePrimitives matmul2d): the same
// contract, arguments (kp::LinearParams, kp::GemmArgs), buffer indices, grid and threadgroup as gemm.metal,
// which stays the path every machine can run. The host (ops_metal.cpp) picks this one when the device
// reports Device::has_tensor_ops() (Apple: MTLGPUFamilyMetal4 and this file's metallib loaded).
// Per threadgroup: a BM x BN = 32 output tile, K in BK = 32 steps. Each step dequantizes the weight tile
// (and gathers the A rows, through the routing's row index for the expert gate/up projections) into
// threadgroup memory as half (or bfloat), then one matmul2d over all 4 simdgroups multiply-accumulates the
// BM x BK by BK x BN product into an fp32 cooperative tensor that stays in registers across K. The result
// goes through threadgroup memory to the shared epilogue (plain, +=, GLU silu(gate) * up).
// Compiled only by a Metal 4 compiler (-std=metal4.0 defines __HAVE_TENSOR__); csrc/metal/metal.cmake
// builds it into its own metallib, so older SDKs and OS versions keep the simdgroup-matrix path.
#include "gemm_tile.h"

#if defined(__METAL_VERSION__) && __METAL_VERSION__ >= 400 && defined(__HAVE_TENSOR__)
#include <metal_tensor>
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>

constant constexpr int TENSOR_SIMDGROUPS = 4;   // NT / 32: every simdgroup of the threadgroup runs the op

template <int WF, typename T, int BM, bool GLU>
kernel void gemm_tensor(device const float*      a          [[buffer(0)]],    // A [*, lda]
                        device const uchar*      w          [[buffer(1)]],    // W (gate when GLU) [E?, out, in]
                        device const ushort*     ws         [[buffer(2)]],
                        device const ushort*     wb         [[buffer(3)]],
                        device const uchar*      w2         [[buffer(4)]],    // up weight when GLU (else unused)
                        device const ushort*     w2s        [[buffer(5)]],
                        device const ushort*     w2b        [[buffer(6)]],
                        device float*            y          [[buffer(7)]],    // Y [M, ldy]
                        constant kp::LinearParams& la         [[buffer(8)]],
                        constant kp::GemmArgs&   ga         [[buffer(9)]],
                        device const int*        row_index  [[buffer(10)]],   // [pairs] source row (grouped, gather)
                        device const int*        tile_expert [[buffer(11)]],  // [max_tiles]
                        device const int*        tile_row0  [[buffer(12)]],
                        device const int*        tile_rows  [[buffer(13)]],
                        device const int*        n_tiles    [[buffer(14)]],   // [1]
                        uint2 tg   [[threadgroup_position_in_grid]],
                        uint  tid  [[thread_index_in_threadgroup]])
{
    threadgroup T tg_a[BM * BK];
    threadgroup T tg_w[BN * BK];
    threadgroup T tg_w2[GLU ? BN * BK : 1];
    threadgroup float tg_c[BM * BN];
    threadgroup float tg_c2[GLU ? BM * BN : 1];

    uint row0 = tg.y * BM, nrows = 0, expert = 0;
    if (ga.grouped) {
        if (int(tg.y) >= n_tiles[0]) return;   // whole threadgroup: spare tile of the upper-bound grid
        row0 = uint(tile_row0[tg.y]);
        nrows = uint(tile_rows[tg.y]);
        expert = uint(tile_expert[tg.y]);
    } else {
        nrows = row0 < uint(ga.M) ? min(uint(BM), uint(ga.M) - row0) : 0u;
    }
    const uint n0 = tg.x * BN;
    WRef r1{w, ws, wb}, r2{w2, w2s, w2b};
    r1 = w_expert(r1, expert, la);
    r2 = w_expert(r2, expert, la);

    // The tiles as tensors; extent 0 is the contiguous one: A [BM][BK] -> (BK, BM); W [BN][BK] -> (BK, BN),
    // which is B = W^T read with transpose_right.
    typedef tensor<threadgroup T, dextents<int32_t, 2>, tensor_inline> tile_t;
    tile_t ta(tg_a, dextents<int32_t, 2>(int(BK), BM));
    tile_t tw(tg_w, dextents<int32_t, 2>(int(BK), int(BN)));
    tile_t tw2(tg_w2, dextents<int32_t, 2>(int(BK), GLU ? int(BN) : 1));

    constexpr auto desc = mpp::tensor_ops::matmul2d_descriptor(
        BM, int(BN), int(BK), false, true, false, mpp::tensor_ops::matmul2d_descriptor::mode::multiply_accumulate);
    mpp::tensor_ops::matmul2d<desc, execution_simdgroups<TENSOR_SIMDGROUPS>> mm;
    auto acc = mm.template get_destination_cooperative_tensor<tile_t, tile_t, float>();
    auto acc2 = mm.template get_destination_cooperative_tensor<tile_t, tile_t, float>();
    for (ushort i = 0; i < acc.get_capacity(); i++) {
        if (acc.get_mask(i)) acc[i] = 0.0f;
        if (acc2.get_mask(i)) acc2[i] = 0.0f;
    }

    const uint K = uint(la.in);
    for (uint k0 = 0; k0 < K; k0 += BK) {
        load_a_tile<T, BM>(tg_a, a, row_index, row0, nrows, k0, K, ga, tid);
        load_w_tile<WF, T>(tg_w, r1, n0, k0, la, tid);
        if (GLU) load_w_tile<WF, T>(tg_w2, r2, n0, k0, la, tid);
        threadgroup_barrier(mem_flags::mem_threadgroup);   // tiles written by all simdgroups, read by the op
        mm.run(ta, tw, acc);
        if (GLU) mm.run(ta, tw2, acc2);
        threadgroup_barrier(mem_flags::mem_threadgroup);   // the op has read the tiles before they are reused
    }
    typedef tensor<threadgroup float, dextents<int32_t, 2>, tensor_inline> out_t;
    acc.store(out_t(tg_c, dextents<int32_t, 2>(int(BN), BM)));
    if (GLU) acc2.store(out_t(tg_c2, dextents<int32_t, 2>(int(BN), GLU ? BM : 1)));
    threadgroup_barrier(mem_flags::mem_threadgroup);
    store_c_tile<BM, GLU>(y, tg_c, tg_c2, row0, nrows, n0, la, ga, tid);
}

// half tiles (the default of the host: 11-bit mantissa, activations must stay below 65504)
template [[host_name("gemm_tensor_q4_f16_bm32")]] [[kernel]] decltype(gemm_tensor<WF_Q4, half, 32, false>) gemm_tensor<WF_Q4, half, 32, false>;
template [[host_name("gemm_tensor_q4_f16_bm16")]] [[kernel]] decltype(gemm_tensor<WF_Q4, half, 16, false>) gemm_tensor<WF_Q4, half, 16, false>;
template [[host_name("gemm_tensor_q8_f16_bm32")]] [[kernel]] decltype(gemm_tensor<WF_Q8, half, 32, false>) gemm_tensor<WF_Q8, half, 32, false>;
template [[host_name("gemm_tensor_q8_f16_bm16")]] [[kernel]] decltype(gemm_tensor<WF_Q8, half, 16, false>) gemm_tensor<WF_Q8, half, 16, false>;
template [[host_name("gemm_tensor_bf16_f16_bm32")]] [[kernel]] decltype(gemm_tensor<WF_BF16, half, 32, false>) gemm_tensor<WF_BF16, half, 32, false>;
template [[host_name("gemm_tensor_bf16_f16_bm16")]] [[kernel]] decltype(gemm_tensor<WF_BF16, half, 16, false>) gemm_tensor<WF_BF16, half, 16, false>;
template [[host_name("gemm_tensor_glu_q4_f16_bm32")]] [[kernel]] decltype(gemm_tensor<WF_Q4, half, 32, true>) gemm_tensor<WF_Q4, half, 32, true>;
template [[host_name("gemm_tensor_glu_q4_f16_bm16")]] [[kernel]] decltype(gemm_tensor<WF_Q4, half, 16, true>) gemm_tensor<WF_Q4, half, 16, true>;
template [[host_name("gemm_tensor_glu_bf16_f16_bm32")]] [[kernel]] decltype(gemm_tensor<WF_BF16, half, 32, true>) gemm_tensor<WF_BF16, half, 32, true>;
template [[host_name("gemm_tensor_glu_bf16_f16_bm16")]] [[kernel]] decltype(gemm_tensor<WF_BF16, half, 16, true>) gemm_tensor<WF_BF16, half, 16, true>;
// bfloat tiles (fp32 range, 8-bit mantissa): for activations beyond half's range
template [[host_name("gemm_tensor_q4_bf16_bm32")]] [[kernel]] decltype(gemm_tensor<WF_Q4, bfloat, 32, false>) gemm_tensor<WF_Q4, bfloat, 32, false>;
template [[host_name("gemm_tensor_glu_q4_bf16_bm32")]] [[kernel]] decltype(gemm_tensor<WF_Q4, bfloat, 32, true>) gemm_tensor<WF_Q4, bfloat, 32, true>;

#endif  // __HAVE_TENSOR__
