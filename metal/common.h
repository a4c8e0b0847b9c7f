// Helpers shared by lily's Metal kernels: bf16 bits, weight formats, row-chunk dot products.
// Activations are fp32 in device memory; weights stay in their checkpoint format (MLX affine 4/8-bit
// codes with bf16 scales/biases, or dense bf16/f32) and are dequantized in registers.
#pragma once
#include <metal_stdlib>
#include "kernels/params.h"
using namespace metal;
namespace kp = lily::kp;

// Weight formats (template parameter WF of the linear kernels): kp::WeightFormat in params.h.
constant constexpr int WF_Q4 = 0;
constant constexpr int WF_Q8 = 1;
constant constexpr int WF_BF16 = 2;
constant constexpr int WF_F32 = 3;

inline float bf16(ushort b) { return as_type<float>(uint(b) << 16); }
// float -> bf16 bits, round to nearest even (finite inputs).
inline ushort to_bf16(float f) {
    const uint u = as_type<uint>(f);
    return ushort((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// KV cache element access: fp32, or bf16 bits in ushort (half the bytes per token).
template <typename KVT> struct kv_io;
template <> struct kv_io<float> {
    static float load(device const float* p, ulong i) { return p[i]; }
    static void store(device float* p, ulong i, float v) { p[i] = v; }
};
template <> struct kv_io<ushort> {
    static float load(device const ushort* p, ulong i) { return bf16(p[i]); }
    static void store(device ushort* p, ulong i, float v) { p[i] = to_bf16(v); }
};
inline float silu(float x) { return x / (1.0f + exp(-x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + exp(-x)); }

// Values per chunk: one lane reads one 16-byte (32-byte for f32) chunk of a weight row per step.
constexpr int wf_vpc(int wf) { return wf == WF_Q4 ? 32 : wf == WF_Q8 ? 16 : 8; }

// One linear layer's buffers; `w` holds codes (quantized) or the dense matrix.
struct WRef {
    device const uchar*  w;
    device const ushort* s;
    device const ushort* b;
};

// Expert e of a stacked weight [E, out, in].
inline WRef w_expert(WRef r, uint e, constant kp::LinearParams& a) {
    WRef o = r;
    if (a.kind == 0) {  // quantized: codes and scales / biases per expert
        o.w += ulong(e) * ulong(a.expert_words) * 4u;
        o.s += ulong(e) * ulong(a.expert_groups);
        o.b += ulong(e) * ulong(a.expert_groups);
    } else {
        o.w += ulong(e) * ulong(a.expert_elems) * (a.kind == 1 ? 2u : 4u);
    }
    return o;
}

// Loads chunk c of activation row x (VPC floats) into registers; returns their sum (for affine biases).
template <int WF>
inline float load_x_chunk(device const float* x, uint c, thread float* xv) {
    constexpr int VPC = wf_vpc(WF);
    float sum = 0.0f;
    for (int i = 0; i < VPC; i += 4) {
        const float4 v = *(device const float4*)(x + c * VPC + i);
        xv[i] = v.x; xv[i + 1] = v.y; xv[i + 2] = v.z; xv[i + 3] = v.w;
        sum += (v.x + v.y) + (v.z + v.w);
    }
    return sum;
}

// One 16-byte chunk of a weight row (chunk c of row `row`), dequantized once so that it serves several x rows: the
// values (quantized: the codes as floats, exact) and, quantized, the chunk's group scale and bias.
template <int WF>
struct WFrag {
    float w[wf_vpc(WF)];
    float s, b;
};

template <int WF>
inline WFrag<WF> w_frag(WRef r, uint row, uint c, constant kp::LinearParams& a) {
    constexpr int VPC = wf_vpc(WF);
    WFrag<WF> f;
    f.s = 0.0f, f.b = 0.0f;
    if (WF == WF_Q4 || WF == WF_Q8) {
        constexpr uint BITS = WF == WF_Q4 ? 4 : 8;
        constexpr uint PER = 32 / BITS;
        const ulong words_per_row = ulong(a.in) / PER;
        const uint4 q = *(device const uint4*)((device const uint*)r.w + row * words_per_row + c * 4);
        const ulong g = ulong(row) * ulong(a.in / a.group) + (c * VPC) / uint(a.group);
        for (uint wd = 0; wd < 4; wd++) {
            const uint word = q[wd];
            for (uint i = 0; i < PER; i++) f.w[wd * PER + i] = float((word >> (BITS * i)) & ((1u << BITS) - 1u));
        }
        f.s = bf16(r.s[g]), f.b = bf16(r.b[g]);
    } else if (WF == WF_BF16) {
        device const ushort* p = (device const ushort*)r.w + ulong(row) * a.in + c * VPC;
        const ushort4 u0 = *(device const ushort4*)p, u1 = *(device const ushort4*)(p + 4);
        for (int i = 0; i < 4; i++) { f.w[i] = bf16(u0[i]); f.w[4 + i] = bf16(u1[i]); }
    } else {
        device const float* p = (device const float*)r.w + ulong(row) * a.in + c * VPC;
        const float4 f0 = *(device const float4*)p, f1 = *(device const float4*)(p + 4);
        for (int i = 0; i < 4; i++) { f.w[i] = f0[i]; f.w[4 + i] = f1[i]; }
    }
    return f;
}

// dot(fragment, xv) for one x chunk (xsum: its sum, load_x_chunk). Quantized: s*dot(q, x) + b*sum(x) per group
// (group % VPC == 0). Every caller (one x row or several) runs these operations in this order, so an x row's result
// does not depend on how many rows share the fragment.
template <int WF>
inline float frag_dot(const thread WFrag<WF>& f, const thread float* xv, float xsum) {
    constexpr int VPC = wf_vpc(WF);
    if (WF == WF_Q4 || WF == WF_Q8) {
        float qx = 0.0f;
        for (int j = 0; j < VPC; j++) qx += f.w[j] * xv[j];
        return f.s * qx + f.b * xsum;
    } else if (WF == WF_BF16) {
        float acc = 0.0f;
        for (int i = 0; i < 4; i++) acc += f.w[i] * xv[i] + f.w[4 + i] * xv[4 + i];
        return acc;
    } else {
        return dot(float4(f.w[0], f.w[1], f.w[2], f.w[3]), float4(xv[0], xv[1], xv[2], xv[3])) +
               dot(float4(f.w[4], f.w[5], f.w[6], f.w[7]), float4(xv[4], xv[5], xv[6], xv[7]));
    }
}

// x chunks of NM rows stay in registers across a chunk's weight rows while they take at most 64 floats; above,
// each use loads its chunk again (the same loads, so the same values).
constexpr bool x_hold(int wf, int nm) { return nm * wf_vpc(wf) <= 64; }

// W[row, k] dequantized (used by the GEMM tile loaders).
template <int WF>
inline float w_at(WRef r, uint row, uint k, constant kp::LinearParams& a) {
    if (WF == WF_Q4 || WF == WF_Q8) {
        constexpr uint BITS = WF == WF_Q4 ? 4 : 8;
        constexpr uint PER = 32 / BITS;
        const uint word = ((device const uint*)r.w)[ulong(row) * (a.in / PER) + k / PER];
        const ulong g = ulong(row) * ulong(a.in / a.group) + k / uint(a.group);
        return bf16(r.s[g]) * float((word >> (BITS * (k % PER))) & ((1u << BITS) - 1u)) + bf16(r.b[g]);
    } else if (WF == WF_BF16) {
        return bf16(((device const ushort*)r.w)[ulong(row) * a.in + k]);
    } else {
        return ((device const float*)r.w)[ulong(row) * a.in + k];
    }
}
