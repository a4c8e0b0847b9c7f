// GEMM tile geometry and the weight-tile loader shared by the prefill GEMMs: gemm.metal (simdgroup
// matrices, every machine) and gemm_tensor.metal (Metal 4 tensor ops behind a runtime capability check).
#pragma once
#include "common.h"

constant constexpr uint BN = 32;
constant constexpr uint BK = 32;
constant constexpr uint NT = 128;

// Dequantizes W[n0 .. n0+BN, k0 .. k0+BK) into dst [BN][BK]; rows >= out and columns >= in are zero.
template <int WF, typename T>
inline void load_w_tile(threadgroup T* dst, WRef r, uint n0, uint k0, constant kp::LinearParams& la, uint tid) {
    if (WF == WF_Q4 || WF == WF_Q8) {
        // One 32-bit word (8 or 4 codes) per step; in is a multiple of the group size (>= 32).
        constexpr uint BITS = WF == WF_Q4 ? 4 : 8;
        constexpr uint PER = 32 / BITS;
        constexpr uint WPR = BK / PER;
        const uint words_per_row = uint(la.in) / PER;
        for (uint idx = tid; idx < BN * WPR; idx += NT) {
            const uint n = idx / WPR, wi = idx % WPR, k = k0 + wi * PER;
            threadgroup T* d = dst + n * BK + wi * PER;
            if (n0 + n < uint(la.out) && k < uint(la.in)) {
                const ulong row = n0 + n;
                const uint word = ((device const uint*)r.w)[row * words_per_row + k / PER];
                const ulong g = row * ulong(la.in / la.group) + k / uint(la.group);
                const float s = bf16(r.s[g]), b = bf16(r.b[g]);
                for (uint i = 0; i < PER; i++) d[i] = T(s * float((word >> (BITS * i)) & ((1u << BITS) - 1u)) + b);
            } else {
                for (uint i = 0; i < PER; i++) d[i] = T(0.0f);
            }
        }
    } else {
        for (uint idx = tid; idx < BN * BK; idx += NT) {
            const uint n = idx / BK, k = k0 + idx % BK;
            dst[idx] = (n0 + n < uint(la.out) && k < uint(la.in)) ? T(w_at<WF>(r, n0 + n, k, la)) : T(0.0f);
        }
    }
}

// A rows [row0, row0 + nrows) (plain), or pairs gathered through row_index (grouped gate/up), columns
// [k0, k0 + BK) into dst [BM][BK]; rows >= nrows and columns >= K are zero.
template <typename T, int BM>
inline void load_a_tile(threadgroup T* dst, device const float* a, device const int* row_index, uint row0, uint nrows,
                        uint k0, uint K, constant kp::GemmArgs& ga, uint tid) {
    for (uint idx = tid; idx < BM * BK; idx += NT) {
        const uint i = idx / BK, k = k0 + idx % BK;
        float v = 0.0f;
        if (i < nrows && k < K) {
            const uint p = row0 + i;
            const uint src = (ga.grouped && ga.gather) ? uint(row_index[p]) : p;
            v = a[ulong(src) * ulong(ga.lda) + k];
        }
        dst[idx] = T(v);
    }
}

// Epilogue from the fp32 result tiles c (c2: up projection when GLU) [BM][BN]: Y = R, Y += R, or
// Y = silu(R_gate) * R_up, for rows < nrows and columns < out.
template <int BM, bool GLU>
inline void store_c_tile(device float* y, threadgroup const float* c, threadgroup const float* c2, uint row0, uint nrows,
                         uint n0, constant kp::LinearParams& la, constant kp::GemmArgs& ga, uint tid) {
    for (uint idx = tid; idx < BM * BN; idx += NT) {
        const uint i = idx / BN, n = n0 + idx % BN;
        if (i >= nrows || n >= uint(la.out)) continue;
        device float* dst = y + ulong(row0 + i) * ulong(ga.ldy) + n;
        const float v = GLU ? silu(c[idx]) * c2[idx] : c[idx];
        *dst = (!GLU && ga.epilogue == 1) ? *dst + v : v;
    }
}
