// Sparse MoE on the GPU (docs/model.md §4.4; docs/metal.md, Kernels: routing, fused decode chains).
// Routing, all in one command buffer with no host round trip: moe_topk (softmax over E, top-k, renorm)
// -> moe_count (per block of rows: expert histogram) -> moe_offsets (scan: expert offsets, per-block
// bases, block map of BM-row tiles for the grouped GEMM) -> moe_scatter (stable: rows ascending within
// an expert, so results do not depend on thread timing) -> gemm (grouped) -> moe_combine.
// Decode (NM <= 8 rows: a step, a verify, streams decoded together): moe_gate_up_decode (8 routed experts + shared
// expert, SiLU(gate)*up in registers) and moe_down_decode (routing weights, shared expert gate and the residual add
// fused); each expert any row chose is streamed once for all of them, and each row is what it is decoded alone.
#include "common.h"

// One simdgroup per row; lane holds experts e = lane + 32*j (E <= 32*MAXJ). Ties go to the lower id.
template <int MAXJ>
kernel void moe_topk(device const float*    logits [[buffer(0)]],   // [S, E]
                     device int*            ids    [[buffer(1)]],   // [S, k]
                     device float*          wts    [[buffer(2)]],   // [S, k]
                     constant kp::RouteArgs& ra    [[buffer(3)]],
                     uint s    [[threadgroup_position_in_grid]],
                     uint lane [[thread_index_in_simdgroup]])
{
    const uint E = uint(ra.n_experts), k = uint(ra.top_k);
    float p[MAXJ];
    float mx = -INFINITY;
    for (uint j = 0; j < MAXJ; j++) {
        const uint e = lane + 32 * j;
        p[j] = e < E ? logits[ulong(s) * E + e] : -INFINITY;
        mx = max(mx, p[j]);
    }
    mx = simd_max(mx);
    float sum = 0.0f;
    for (uint j = 0; j < MAXJ; j++) {
        p[j] = lane + 32 * j < E ? exp(p[j] - mx) : 0.0f;
        sum += p[j];
    }
    sum = simd_sum(sum);
    for (uint j = 0; j < MAXJ; j++) p[j] = lane + 32 * j < E ? p[j] / sum : -1.0f;   // taken/absent: -1
    float chosen = 0.0f;
    for (uint r = 0; r < k; r++) {
        // A non-finite row (a NaN upstream: no p beats -1) picks expert 0 with a NaN weight, never an id past E
        // (which moe_count would use as an index).
        float best = -1.0f;
        uint bi = 0;
        for (uint j = 0; j < MAXJ; j++)
            if (p[j] > best) { best = p[j]; bi = lane + 32 * j; }
        const float top = simd_max(best);
        const uint e = simd_min(best == top ? bi : 0xffffffffu);
        if (e % 32 == lane) p[e / 32] = -1.0f;
        const float w = top < -0.5f ? as_type<float>(0x7fc00000u) : top;
        chosen += w;
        if (lane == 0) { ids[s * k + r] = int(e); wts[s * k + r] = w; }
    }
    if (lane == 0 && ra.norm_topk)
        for (uint r = 0; r < k; r++) wts[s * k + r] /= chosen;
}

// counts[b, e] = number of rows of block b routed to expert e. One thread per row of the block.
kernel void moe_count(device const int*      ids    [[buffer(0)]],   // [S, k]
                      device int*            counts [[buffer(1)]],   // [n_blocks, E]
                      constant kp::RouteArgs& ra    [[buffer(2)]],
                      uint b   [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint nt  [[threads_per_threadgroup]])
{
    threadgroup atomic_int tg_counts[1024];
    const uint E = uint(ra.n_experts), k = uint(ra.top_k);
    for (uint e = tid; e < E; e += nt) atomic_store_explicit(&tg_counts[e], 0, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint row = b * uint(ra.block_rows) + tid;
    if (tid < uint(ra.block_rows) && row < uint(ra.S))
        for (uint j = 0; j < k; j++) atomic_fetch_add_explicit(&tg_counts[ids[row * k + j]], 1, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = tid; e < E; e += nt) counts[b * E + e] = atomic_load_explicit(&tg_counts[e], memory_order_relaxed);
}

// One threadgroup (E <= threads <= 1024): expert totals, offsets (exclusive scan), per-block bases
// base[b, e] = offset[e] + rows of e in blocks < b, and the block map of BM-row tiles in expert order.
kernel void moe_offsets(device const int*      counts      [[buffer(0)]],   // [n_blocks, E]
                        device int*            base        [[buffer(1)]],   // [n_blocks, E]
                        device int*            tile_expert [[buffer(2)]],   // [max_tiles]
                        device int*            tile_row0   [[buffer(3)]],
                        device int*            tile_rows   [[buffer(4)]],
                        device int*            n_tiles     [[buffer(5)]],   // [1]
                        constant kp::RouteArgs& ra         [[buffer(6)]],
                        uint tid  [[thread_index_in_threadgroup]],
                        uint sg   [[simdgroup_index_in_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]],
                        uint nsg  [[simdgroups_per_threadgroup]])
{
    threadgroup int tg_rows[32];
    threadgroup int tg_tiles[32];
    const uint E = uint(ra.n_experts), nb = uint(ra.n_blocks), BM = uint(ra.tile_rows);
    const uint e = tid;
    int total = 0;
    if (e < E)
        for (uint b = 0; b < nb; b++) total += counts[b * E + e];
    const int ntile = (total + int(BM) - 1) / int(BM);
    // two-level exclusive scans over e of total and ntile
    const int r_in = simd_prefix_exclusive_sum(total), t_in = simd_prefix_exclusive_sum(ntile);
    const int r_sg = simd_sum(total), t_sg = simd_sum(ntile);
    if (lane == 0) { tg_rows[sg] = r_sg; tg_tiles[sg] = t_sg; }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    int offset = r_in, tile0 = t_in, all_tiles = 0;
    for (uint i = 0; i < nsg; i++) {
        if (i < sg) { offset += tg_rows[i]; tile0 += tg_tiles[i]; }
        all_tiles += tg_tiles[i];
    }
    if (e < E) {
        int run = offset;
        for (uint b = 0; b < nb; b++) { base[b * E + e] = run; run += counts[b * E + e]; }
        for (int t = 0; t < ntile; t++) {
            const int i = tile0 + t;
            if (i >= ra.max_tiles) break;
            tile_expert[i] = int(e);
            tile_row0[i] = offset + t * int(BM);
            tile_rows[i] = min(int(BM), total - t * int(BM));
        }
    }
    if (tid == 0) n_tiles[0] = min(all_tiles, ra.max_tiles);
}

// Stable scatter of (row, j) pairs into expert order; inv[row, j] = sorted position. One thread per row.
kernel void moe_scatter(device const int*      ids        [[buffer(0)]],   // [S, k]
                        device const float*    wts        [[buffer(1)]],   // [S, k]
                        device const int*      base       [[buffer(2)]],   // [n_blocks, E]
                        device int*            sorted_row [[buffer(3)]],   // [S*k]
                        device float*          sorted_w   [[buffer(4)]],   // [S*k]
                        device int*            inv        [[buffer(5)]],   // [S, k]
                        constant kp::RouteArgs& ra        [[buffer(6)]],
                        uint b   [[threadgroup_position_in_grid]],
                        uint tid [[thread_index_in_threadgroup]])
{
    threadgroup int tg_ids[32 * 8];
    const uint k = uint(ra.top_k), R = uint(ra.block_rows), E = uint(ra.n_experts);
    const uint row = b * R + tid;
    const bool valid = tid < R && row < uint(ra.S);
    if (tid < R)
        for (uint j = 0; j < k; j++) tg_ids[tid * k + j] = valid ? ids[row * k + j] : -1;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (!valid) return;
    for (uint j = 0; j < k; j++) {
        const int e = tg_ids[tid * k + j];
        int rank = 0;
        for (uint r = 0; r < tid; r++)
            for (uint jj = 0; jj < k; jj++) rank += tg_ids[r * k + jj] == e ? 1 : 0;
        const int pos = base[b * E + uint(e)] + rank;
        sorted_row[pos] = int(row);
        sorted_w[pos] = wts[row * k + j];
        inv[row * k + j] = pos;
    }
}

// x[s, :] += sum_j w[s, j] * yd[inv[s, j], :] + sigmoid(sg[s]) * ysh[s, :]. Grid (ceil(H / threads), S).
kernel void moe_combine(device float*          x    [[buffer(0)]],   // [S, H] residual
                        device const float*    yd   [[buffer(1)]],   // [S*k, H] expert outputs, sorted
                        device const float*    ysh  [[buffer(2)]],   // [S, H] shared expert output
                        device const float*    sg   [[buffer(3)]],   // [S] shared expert gate logit
                        device const int*      inv  [[buffer(4)]],   // [S, k]
                        device const float*    wts  [[buffer(5)]],   // [S, k]
                        constant kp::MoeParams& mp  [[buffer(6)]],
                        uint2 gid [[thread_position_in_grid]])
{
    const uint H = uint(mp.hidden), k = uint(mp.top_k), s = gid.y, i = gid.x;
    if (i >= H) return;
    float m = 0.0f;
    for (uint j = 0; j < k; j++) m += wts[s * k + j] * yd[ulong(inv[s * k + j]) * H + i];
    m += sigmoid(sg[s]) * ysh[ulong(s) * H + i];
    x[ulong(s) * H + i] += m;
}

// The rows of an NM-row decode that expert pair p serves (the union of the rows' experts, each streamed once).
// p < NM*k names pair (m0, j0) = (p / k, p % k) and expert e = ids[m0, j0]: it serves row m0 at slot j0 and every later
// row that chose e, at that row's slot, unless an earlier row chose e (then the earlier row's pair serves them all:
// returns false). p = NM*k: the shared expert, slot k of every row. slot[m] = -1: row m is not served. A row's ids are
// distinct (moe_topk), except a non-finite row's repeated expert 0 with NaN weights, whose output is NaN either way.
template <int NM>
inline bool pair_rows(device const int* ids, uint k, uint p, thread int* slot, thread uint& e) {
    if (p == NM * k) {
        for (int m = 0; m < NM; m++) slot[m] = int(k);
        e = 0;
        return true;
    }
    const uint m0 = p / k;
    e = uint(ids[p]);
    for (int m = 0; m < NM; m++) {
        slot[m] = uint(m) == m0 ? int(p % k) : -1;
        for (uint j = 0; j < k && uint(m) != m0; j++)
            if (uint(ids[uint(m) * k + j]) == e) {
                if (uint(m) < m0) return false;
                if (slot[m] < 0) slot[m] = int(j);
            }
    }
    return true;
}

// Decode of NM rows: act[m, j, r] = silu(Wg_e[r] . h[m]) * (Wu_e[r] . h[m]) for each row m and slot j, e = ids[m, j];
// slot k is the shared expert. Threadgroup y = p names an expert pair (pair_rows): its weights are read once for the
// rows it serves, h chunks read once per chunk for both weights. Row m's values are bit-equal to an NM = 1 launch on
// row m alone (same lanes, chunks and frag_dot order). Grid (ceil(max(I, Is) / (ROWS*NSG)), NM*k + 1).
template <int WF, int ROWS, int NM>
kernel void moe_gate_up_decode(device const float*        h    [[buffer(0)]],    // [NM, H]
                               device const int*          ids  [[buffer(1)]],    // [NM, k]
                               device const uchar*        gw   [[buffer(2)]],    // routed gate [E, I, H]
                               device const ushort*       gs   [[buffer(3)]],
                               device const ushort*       gb   [[buffer(4)]],
                               device const uchar*        uw   [[buffer(5)]],    // routed up [E, I, H]
                               device const ushort*       us   [[buffer(6)]],
                               device const ushort*       ub   [[buffer(7)]],
                               device const uchar*        sgw  [[buffer(8)]],    // shared gate [Is, H]
                               device const ushort*       sgs  [[buffer(9)]],
                               device const ushort*       sgb  [[buffer(10)]],
                               device const uchar*        suw  [[buffer(11)]],   // shared up [Is, H]
                               device const ushort*       sus  [[buffer(12)]],
                               device const ushort*       sub  [[buffer(13)]],
                               device float*              act  [[buffer(14)]],   // [NM, k+1, act_stride]
                               constant kp::LinearParams&   la   [[buffer(15)]],   // routed gate/up
                               constant kp::LinearParams&   las  [[buffer(16)]],   // shared gate/up
                               constant kp::MoeDecodeArgs& ma  [[buffer(17)]],
                               uint2 tg   [[threadgroup_position_in_grid]],
                               uint  sg   [[simdgroup_index_in_threadgroup]],
                               uint  nsg  [[simdgroups_per_threadgroup]],
                               uint  lane [[thread_index_in_simdgroup]])
{
    constexpr int VPC = wf_vpc(WF);
    constexpr bool HOLD = x_hold(WF, NM);
    const uint k = uint(ma.top_k);
    int slot[NM];
    uint e;
    if (!pair_rows<NM>(ids, k, tg.y, slot, e)) return;   // another pair serves this expert (whole threadgroup)
    const bool shared = tg.y == NM * k;
    constant kp::LinearParams& a = shared ? las : la;
    WRef g{sgw, sgs, sgb}, u{suw, sus, sub};
    if (!shared) {
        g = w_expert(WRef{gw, gs, gb}, e, la);
        u = w_expert(WRef{uw, us, ub}, e, la);
    }
    const uint rows = uint(a.out), row0 = (tg.x * nsg + sg) * ROWS, H = uint(a.in);
    float ag[NM][ROWS], au[NM][ROWS];
    for (int m = 0; m < NM; m++)
        for (int i = 0; i < ROWS; i++) { ag[m][i] = 0.0f; au[m][i] = 0.0f; }
    for (uint c = lane; c < H / VPC; c += 32) {
        float xsum[NM], xh[HOLD ? NM : 1][VPC];
        for (int m = 0; m < NM; m++)
            if (slot[m] >= 0) xsum[m] = load_x_chunk<WF>(h + m * ulong(H), c, xh[HOLD ? m : 0]);
        for (int i = 0; i < ROWS; i++) {
            if (row0 + i >= rows) continue;
            const WFrag<WF> fg = w_frag<WF>(g, row0 + i, c, a), fu = w_frag<WF>(u, row0 + i, c, a);
            for (int m = 0; m < NM; m++) {
                if (slot[m] < 0) continue;
                float xv[VPC];
                if (!HOLD) load_x_chunk<WF>(h + m * ulong(H), c, xv);
                ag[m][i] += frag_dot<WF>(fg, HOLD ? xh[m] : xv, xsum[m]);
                au[m][i] += frag_dot<WF>(fu, HOLD ? xh[m] : xv, xsum[m]);
            }
        }
    }
    for (int m = 0; m < NM; m++) {
        if (slot[m] < 0) continue;
        device float* am = act + (ulong(m) * (k + 1) + uint(slot[m])) * ulong(ma.act_stride);
        for (int i = 0; i < ROWS; i++) {
            const float gv = simd_sum(ag[m][i]), uv = simd_sum(au[m][i]);
            if (lane == 0 && row0 + i < rows) am[row0 + i] = silu(gv) * uv;
        }
    }
}

// Row m's activations of slot j: act [NM, k+1, act_stride].
inline device const float* act_at(device const float* act, int m, int j, uint k, constant kp::MoeDecodeArgs& ma) {
    return act + (ulong(m) * (k + 1) + uint(j)) * ulong(ma.act_stride);
}

// Largest top_k and simdgroups per threadgroup of moe_down_decode (its per-slot results in threadgroup memory;
// Ops::moe_down_decode checks both).
constant constexpr int MOE_DEC_MAX_K = 8;
constant constexpr int MOE_DEC_MAX_SG = 4;

// Decode of NM rows: x[m, r] += sum_j wts[m, j] (Wd_e[r] . act[m, j]) + sigmoid(sgl[m]) (Wsd[r] . act[m, k]), e =
// ids[m, j], the sum over j in the row's slot order. The threadgroup walks the expert pairs (pair_rows), so each expert
// is streamed once for all the rows that chose it; each (row, slot) dot is reduced on its own (simd_sum) into
// threadgroup memory and each row's sum is formed after the last expert, in slot order, then the shared expert, then
// the residual add. Row m is bit-equal to an NM = 1 launch on row m alone. Grid ceil(H / (ROWS*NSG)).
template <int WF, int ROWS, int NM>
kernel void moe_down_decode(device const float*        act  [[buffer(0)]],    // [NM, k+1, act_stride]
                            device const int*          ids  [[buffer(1)]],    // [NM, k]
                            device const float*        wts  [[buffer(2)]],    // [NM, k]
                            device const float*        sgl  [[buffer(3)]],    // [NM] shared gate logits
                            device const uchar*        dw   [[buffer(4)]],    // routed down [E, H, I]
                            device const ushort*       ds   [[buffer(5)]],
                            device const ushort*       db   [[buffer(6)]],
                            device const uchar*        sdw  [[buffer(7)]],    // shared down [H, Is]
                            device const ushort*       sds  [[buffer(8)]],
                            device const ushort*       sdb  [[buffer(9)]],
                            device float*              x    [[buffer(10)]],   // [NM, H] residual
                            constant kp::LinearParams&   la   [[buffer(11)]],   // routed down
                            constant kp::LinearParams&   las  [[buffer(12)]],   // shared down
                            constant kp::MoeDecodeArgs& ma  [[buffer(13)]],
                            uint  tg   [[threadgroup_position_in_grid]],
                            uint  sg   [[simdgroup_index_in_threadgroup]],
                            uint  nsg  [[simdgroups_per_threadgroup]],
                            uint  lane [[thread_index_in_simdgroup]])
{
    // (row, slot, output row) results of this simdgroup: written and read by its lane 0 only
    threadgroup float tg_y[MOE_DEC_MAX_SG * NM * (MOE_DEC_MAX_K + 1) * ROWS];
    constexpr int VPC = wf_vpc(WF);
    constexpr bool HOLD = x_hold(WF, NM);
    const uint H = uint(la.out), row0 = (tg * nsg + sg) * ROWS, k = uint(ma.top_k);
    threadgroup float* ys = tg_y + sg * NM * (MOE_DEC_MAX_K + 1) * ROWS;
    for (uint p = 0; p <= NM * k; p++) {
        int slot[NM];
        uint e;
        if (!pair_rows<NM>(ids, k, p, slot, e)) continue;
        const bool shared = p == NM * k;
        constant kp::LinearParams& a = shared ? las : la;
        WRef d{sdw, sds, sdb};
        if (!shared) d = w_expert(WRef{dw, ds, db}, e, la);
        float acc[NM][ROWS];
        for (int m = 0; m < NM; m++)
            for (int i = 0; i < ROWS; i++) acc[m][i] = 0.0f;
        for (uint c = lane; c < uint(a.in) / VPC; c += 32) {
            float xsum[NM], xh[HOLD ? NM : 1][VPC];
            for (int m = 0; m < NM; m++)
                if (slot[m] >= 0) xsum[m] = load_x_chunk<WF>(act_at(act, m, slot[m], k, ma), c, xh[HOLD ? m : 0]);
            for (int i = 0; i < ROWS; i++) {
                if (row0 + i >= H) continue;
                const WFrag<WF> f = w_frag<WF>(d, row0 + i, c, a);
                for (int m = 0; m < NM; m++) {
                    if (slot[m] < 0) continue;
                    float xv[VPC];
                    if (!HOLD) load_x_chunk<WF>(act_at(act, m, slot[m], k, ma), c, xv);
                    acc[m][i] += frag_dot<WF>(f, HOLD ? xh[m] : xv, xsum[m]);
                }
            }
        }
        for (int m = 0; m < NM; m++) {
            if (slot[m] < 0) continue;
            for (int i = 0; i < ROWS; i++) {
                const float v = simd_sum(acc[m][i]);
                if (lane == 0) ys[(m * (MOE_DEC_MAX_K + 1) + slot[m]) * ROWS + i] = v;
            }
        }
    }
    if (lane != 0) return;
    for (int m = 0; m < NM; m++) {
        const threadgroup float* ym = ys + m * (MOE_DEC_MAX_K + 1) * ROWS;
        for (int i = 0; i < ROWS; i++) {
            if (row0 + i >= H) continue;
            float v = 0.0f;
            for (uint j = 0; j < k; j++) v += wts[uint(m) * k + j] * ym[j * ROWS + i];
            v += sigmoid(sgl[m]) * ym[k * ROWS + i];
            x[ulong(m) * H + row0 + i] += v;
        }
    }
}

template [[host_name("moe_topk_j8")]] [[kernel]] decltype(moe_topk<8>) moe_topk<8>;
template [[host_name("moe_topk_j1")]] [[kernel]] decltype(moe_topk<1>) moe_topk<1>;
// <kernel>_<fmt>: one row (decode); <kernel>_<fmt>_m<NM>: NM rows (MetalBackend::moe_decode, exact rows).
template [[host_name("moe_gate_up_decode_q4")]] [[kernel]] decltype(moe_gate_up_decode<WF_Q4, 4, 1>) moe_gate_up_decode<WF_Q4, 4, 1>;
template [[host_name("moe_gate_up_decode_q4_m2")]] [[kernel]] decltype(moe_gate_up_decode<WF_Q4, 4, 2>) moe_gate_up_decode<WF_Q4, 4, 2>;
template [[host_name("moe_gate_up_decode_q4_m3")]] [[kernel]] decltype(moe_gate_up_decode<WF_Q4, 4, 3>) moe_gate_up_decode<WF_Q4, 4, 3>;
template [[host_name("moe_gate_up_decode_q4_m4")]] [[kernel]] decltype(moe_gate_up_decode<WF_Q4, 4, 4>) moe_gate_up_decode<WF_Q4, 4, 4>;
template [[host_name("moe_gate_up_decode_q4_m5")]] [[kernel]] decltype(moe_gate_up_decode<WF_Q4, 4, 5>) moe_gate_up_decode<WF_Q4, 4, 5>;
template [[host_name("moe_gate_up_decode_q4_m6")]] [[kernel]] decltype(moe_gate_up_decode<WF_Q4, 4, 6>) moe_gate_up_decode<WF_Q4, 4, 6>;
template [[host_name("moe_gate_up_decode_q4_m7")]] [[kernel]] decltype(moe_gate_up_decode<WF_Q4, 4, 7>) moe_gate_up_decode<WF_Q4, 4, 7>;
template [[host_name("moe_gate_up_decode_q4_m8")]] [[kernel]] decltype(moe_gate_up_decode<WF_Q4, 4, 8>) moe_gate_up_decode<WF_Q4, 4, 8>;
template [[host_name("moe_gate_up_decode_bf16")]] [[kernel]] decltype(moe_gate_up_decode<WF_BF16, 4, 1>) moe_gate_up_decode<WF_BF16, 4, 1>;
template [[host_name("moe_gate_up_decode_bf16_m2")]] [[kernel]] decltype(moe_gate_up_decode<WF_BF16, 4, 2>) moe_gate_up_decode<WF_BF16, 4, 2>;
template [[host_name("moe_gate_up_decode_bf16_m3")]] [[kernel]] decltype(moe_gate_up_decode<WF_BF16, 4, 3>) moe_gate_up_decode<WF_BF16, 4, 3>;
template [[host_name("moe_gate_up_decode_bf16_m4")]] [[kernel]] decltype(moe_gate_up_decode<WF_BF16, 4, 4>) moe_gate_up_decode<WF_BF16, 4, 4>;
template [[host_name("moe_gate_up_decode_bf16_m5")]] [[kernel]] decltype(moe_gate_up_decode<WF_BF16, 4, 5>) moe_gate_up_decode<WF_BF16, 4, 5>;
template [[host_name("moe_gate_up_decode_bf16_m6")]] [[kernel]] decltype(moe_gate_up_decode<WF_BF16, 4, 6>) moe_gate_up_decode<WF_BF16, 4, 6>;
template [[host_name("moe_gate_up_decode_bf16_m7")]] [[kernel]] decltype(moe_gate_up_decode<WF_BF16, 4, 7>) moe_gate_up_decode<WF_BF16, 4, 7>;
template [[host_name("moe_gate_up_decode_bf16_m8")]] [[kernel]] decltype(moe_gate_up_decode<WF_BF16, 4, 8>) moe_gate_up_decode<WF_BF16, 4, 8>;
template [[host_name("moe_down_decode_q4")]] [[kernel]] decltype(moe_down_decode<WF_Q4, 4, 1>) moe_down_decode<WF_Q4, 4, 1>;
template [[host_name("moe_down_decode_q4_m2")]] [[kernel]] decltype(moe_down_decode<WF_Q4, 4, 2>) moe_down_decode<WF_Q4, 4, 2>;
template [[host_name("moe_down_decode_q4_m3")]] [[kernel]] decltype(moe_down_decode<WF_Q4, 4, 3>) moe_down_decode<WF_Q4, 4, 3>;
template [[host_name("moe_down_decode_q4_m4")]] [[kernel]] decltype(moe_down_decode<WF_Q4, 4, 4>) moe_down_decode<WF_Q4, 4, 4>;
template [[host_name("moe_down_decode_q4_m5")]] [[kernel]] decltype(moe_down_decode<WF_Q4, 4, 5>) moe_down_decode<WF_Q4, 4, 5>;
template [[host_name("moe_down_decode_q4_m6")]] [[kernel]] decltype(moe_down_decode<WF_Q4, 4, 6>) moe_down_decode<WF_Q4, 4, 6>;
template [[host_name("moe_down_decode_q4_m7")]] [[kernel]] decltype(moe_down_decode<WF_Q4, 4, 7>) moe_down_decode<WF_Q4, 4, 7>;
template [[host_name("moe_down_decode_q4_m8")]] [[kernel]] decltype(moe_down_decode<WF_Q4, 4, 8>) moe_down_decode<WF_Q4, 4, 8>;
template [[host_name("moe_down_decode_bf16")]] [[kernel]] decltype(moe_down_decode<WF_BF16, 4, 1>) moe_down_decode<WF_BF16, 4, 1>;
template [[host_name("moe_down_decode_bf16_m2")]] [[kernel]] decltype(moe_down_decode<WF_BF16, 4, 2>) moe_down_decode<WF_BF16, 4, 2>;
template [[host_name("moe_down_decode_bf16_m3")]] [[kernel]] decltype(moe_down_decode<WF_BF16, 4, 3>) moe_down_decode<WF_BF16, 4, 3>;
template [[host_name("moe_down_decode_bf16_m4")]] [[kernel]] decltype(moe_down_decode<WF_BF16, 4, 4>) moe_down_decode<WF_BF16, 4, 4>;
template [[host_name("moe_down_decode_bf16_m5")]] [[kernel]] decltype(moe_down_decode<WF_BF16, 4, 5>) moe_down_decode<WF_BF16, 4, 5>;
template [[host_name("moe_down_decode_bf16_m6")]] [[kernel]] decltype(moe_down_decode<WF_BF16, 4, 6>) moe_down_decode<WF_BF16, 4, 6>;
template [[host_name("moe_down_decode_bf16_m7")]] [[kernel]] decltype(moe_down_decode<WF_BF16, 4, 7>) moe_down_decode<WF_BF16, 4, 7>;
template [[host_name("moe_down_decode_bf16_m8")]] [[kernel]] decltype(moe_down_decode<WF_BF16, 4, 8>) moe_down_decode<WF_BF16, 4, 8>;
