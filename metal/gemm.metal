// Fused-dequant GEMM for prefill (docs/metal.md, Kernels: GEMM): Y[p, n] = A[row(p), :] . W[n, :] with W in
// its checkpoint format, dequantized one BN x BK tile at a time into threadgroup memory (the full bf16
// weight never exists), multiplied on 8x8 simdgroup matrices with fp32 accumulation.
// Plain: tile t = rows [t*BM, +BM). Grouped (MoE experts): tile t = sorted (row, expert) pairs
// [tile_row0[t], +tile_rows[t]) of expert tile_expert[t] from the routing block map; A rows are gathered
// through row_index (gate/up) or read in pair order (down). BM (16 or 32) is picked from the expert load.
// GLU: two weights (gate, up) share the A tile and the epilogue writes silu(gate) * up.
// Threadgroup: 4 simdgroups; simdgroup s owns output columns [8s, 8s+8) of the BN = 32 tile.
#include "gemm_tile.h"

template <int WF, typename T, int BM, bool GLU>
kernel void gemm(device const float*      a          [[buffer(0)]],    // A [*, lda]
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
                 uint  tid  [[thread_index_in_threadgroup]],
                 uint  sg   [[simdgroup_index_in_threadgroup]])
{
    constexpr uint RT = BM / 8;   // 8x8 row tiles per simdgroup
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

    simdgroup_matrix<float, 8, 8> acc[RT], acc2[GLU ? RT : 1];
    for (uint i = 0; i < RT; i++) acc[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint i = 0; i < (GLU ? RT : 1); i++) acc2[i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

    const uint K = uint(la.in);
    for (uint k0 = 0; k0 < K; k0 += BK) {
        load_a_tile<T, BM>(tg_a, a, row_index, row0, nrows, k0, K, ga, tid);
        load_w_tile<WF, T>(tg_w, r1, n0, k0, la, tid);
        if (GLU) load_w_tile<WF, T>(tg_w2, r2, n0, k0, la, tid);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint kk = 0; kk < BK; kk += 8) {
            simdgroup_matrix<T, 8, 8> mb, mb2, ma;
            simdgroup_load(mb, tg_w + sg * 8 * BK + kk, BK, ulong2(0, 0), true);   // B[k][n] = W[n][k]
            if (GLU) simdgroup_load(mb2, tg_w2 + sg * 8 * BK + kk, BK, ulong2(0, 0), true);
            for (uint i = 0; i < RT; i++) {
                simdgroup_load(ma, tg_a + i * 8 * BK + kk, BK);
                simdgroup_multiply_accumulate(acc[i], ma, mb, acc[i]);
                if (GLU) simdgroup_multiply_accumulate(acc2[i], ma, mb2, acc2[i]);
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (uint i = 0; i < RT; i++) {
        simdgroup_store(acc[i], tg_c + i * 8 * BN + sg * 8, BN);
        if (GLU) simdgroup_store(acc2[i], tg_c2 + i * 8 * BN + sg * 8, BN);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    store_c_tile<BM, GLU>(y, tg_c, tg_c2, row0, nrows, n0, la, ga, tid);
}

template [[host_name("gemm_q4_f32_bm32")]] [[kernel]] decltype(gemm<WF_Q4, float, 32, false>) gemm<WF_Q4, float, 32, false>;
template [[host_name("gemm_q4_f32_bm16")]] [[kernel]] decltype(gemm<WF_Q4, float, 16, false>) gemm<WF_Q4, float, 16, false>;
template [[host_name("gemm_q8_f32_bm32")]] [[kernel]] decltype(gemm<WF_Q8, float, 32, false>) gemm<WF_Q8, float, 32, false>;
template [[host_name("gemm_bf16_f32_bm32")]] [[kernel]] decltype(gemm<WF_BF16, float, 32, false>) gemm<WF_BF16, float, 32, false>;
template [[host_name("gemm_bf16_f32_bm16")]] [[kernel]] decltype(gemm<WF_BF16, float, 16, false>) gemm<WF_BF16, float, 16, false>;
template [[host_name("gemm_f32_f32_bm32")]] [[kernel]] decltype(gemm<WF_F32, float, 32, false>) gemm<WF_F32, float, 32, false>;
template [[host_name("gemm_glu_q4_f32_bm32")]] [[kernel]] decltype(gemm<WF_Q4, float, 32, true>) gemm<WF_Q4, float, 32, true>;
template [[host_name("gemm_glu_q4_f32_bm16")]] [[kernel]] decltype(gemm<WF_Q4, float, 16, true>) gemm<WF_Q4, float, 16, true>;
template [[host_name("gemm_glu_bf16_f32_bm32")]] [[kernel]] decltype(gemm<WF_BF16, float, 32, true>) gemm<WF_BF16, float, 32, true>;
template [[host_name("gemm_glu_bf16_f32_bm16")]] [[kernel]] decltype(gemm<WF_BF16, float, 16, true>) gemm<WF_BF16, float, 16, true>;
// half tiles: the matrix-unit rate path on Apple GPUs (fp32 accumulation, activations rounded to half)
template [[host_name("gemm_q4_f16_bm32")]] [[kernel]] decltype(gemm<WF_Q4, half, 32, false>) gemm<WF_Q4, half, 32, false>;
template [[host_name("gemm_glu_q4_f16_bm32")]] [[kernel]] decltype(gemm<WF_Q4, half, 32, true>) gemm<WF_Q4, half, 32, true>;
