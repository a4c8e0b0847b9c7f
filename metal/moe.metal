// Sparse MoE on the GPU (docs/model.md §4.4; docs/metal.md, Kernels: routing, fused decode chains).
// Routing, all in one command buffer with no host round trip: moe_topk (softmax over E, top-k, renorm)
// -> moe_count (per block of rows: expert histogram) -> moe_offsets (scan: expert offsets, per-block
// bases, block map of BM-row tiles for the grouped GEMM) -> moe_scatter (stable: rows ascending within
// an expert, so results do not depend on thread timing) -> gemm (grouped) -> moe_combine.
// Decode (one row): moe_gate_up_decode (8 routed experts + shared expert, SiLU(gate)*up in registers)
// and moe_down_decode (routing weights, shared expert gate and the residual add fused).
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

// Decode: act[j, r] = silu(Wg_j[r] . h) * (Wu_j[r] . h); slot j < k is routed expert ids[j], slot k the
// shared expert. Grid (ceil(max(I, Is) / (ROWS*NSG)), k + 1); h is read once per chunk for both weights.
template <int WF, int ROWS>
kernel void moe_gate_up_decode(device const float*        h    [[buffer(0)]],    // [H]
                               device const int*          ids  [[buffer(1)]],    // [k]
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
                               device float*              act  [[buffer(14)]],   // [k+1, act_stride]
                               constant kp::LinearParams&   la   [[buffer(15)]],   // routed gate/up
                               constant kp::LinearParams&   las  [[buffer(16)]],   // shared gate/up
                               constant kp::MoeDecodeArgs& ma  [[buffer(17)]],
                               uint2 tg   [[threadgroup_position_in_grid]],
                               uint  sg   [[simdgroup_index_in_threadgroup]],
                               uint  nsg  [[simdgroups_per_threadgroup]],
                               uint  lane [[thread_index_in_simdgroup]])
{
    constexpr int VPC = wf_vpc(WF);
    const uint slot = tg.y;
    const bool shared = slot == uint(ma.top_k);
    constant kp::LinearParams& a = shared ? las : la;
    WRef g{sgw, sgs, sgb}, u{suw, sus, sub};
    if (!shared) {
        g = w_expert(WRef{gw, gs, gb}, uint(ids[slot]), la);
        u = w_expert(WRef{uw, us, ub}, uint(ids[slot]), la);
    }
    const uint rows = uint(a.out), row0 = (tg.x * nsg + sg) * ROWS;
    float ag[ROWS], au[ROWS];
    for (int i = 0; i < ROWS; i++) { ag[i] = 0.0f; au[i] = 0.0f; }
    for (uint c = lane; c < uint(a.in) / VPC; c += 32) {
        float xv[VPC];
        const float xsum = load_x_chunk<WF>(h, c, xv);
        for (int i = 0; i < ROWS; i++)
            if (row0 + i < rows) {
                ag[i] += chunk_dot<WF>(g, row0 + i, c, xv, xsum, a);
                au[i] += chunk_dot<WF>(u, row0 + i, c, xv, xsum, a);
            }
    }
    for (int i = 0; i < ROWS; i++) {
        const float gv = simd_sum(ag[i]), uv = simd_sum(au[i]);
        if (lane == 0 && row0 + i < rows) act[ulong(slot) * ulong(ma.act_stride) + row0 + i] = silu(gv) * uv;
    }
}

// Decode: x[r] += sum_j w_j (Wd_j[r] . act[j]) + sigmoid(sg) (Wsd[r] . act[k]). Grid ceil(H / (ROWS*NSG)).
template <int WF, int ROWS>
kernel void moe_down_decode(device const float*        act  [[buffer(0)]],    // [k+1, act_stride]
                            device const int*          ids  [[buffer(1)]],    // [k]
                            device const float*        wts  [[buffer(2)]],    // [k]
                            device const float*        sgl  [[buffer(3)]],    // [1] shared gate logit
                            device const uchar*        dw   [[buffer(4)]],    // routed down [E, H, I]
                            device const ushort*       ds   [[buffer(5)]],
                            device const ushort*       db   [[buffer(6)]],
                            device const uchar*        sdw  [[buffer(7)]],    // shared down [H, Is]
                            device const ushort*       sds  [[buffer(8)]],
                            device const ushort*       sdb  [[buffer(9)]],
                            device float*              x    [[buffer(10)]],   // [H] residual
                            constant kp::LinearParams&   la   [[buffer(11)]],   // routed down
                            constant kp::LinearParams&   las  [[buffer(12)]],   // shared down
                            constant kp::MoeDecodeArgs& ma  [[buffer(13)]],
                            uint  tg   [[threadgroup_position_in_grid]],
                            uint  sg   [[simdgroup_index_in_threadgroup]],
                            uint  nsg  [[simdgroups_per_threadgroup]],
                            uint  lane [[thread_index_in_simdgroup]])
{
    constexpr int VPC = wf_vpc(WF);
    const uint H = uint(la.out), row0 = (tg * nsg + sg) * ROWS, k = uint(ma.top_k);
    float acc[ROWS];
    for (int i = 0; i < ROWS; i++) acc[i] = 0.0f;
    for (uint j = 0; j <= k; j++) {
        const bool shared = j == k;
        constant kp::LinearParams& a = shared ? las : la;
        WRef d{sdw, sds, sdb};
        if (!shared) d = w_expert(WRef{dw, ds, db}, uint(ids[j]), la);
        const float wj = shared ? sigmoid(sgl[0]) : wts[j];
        device const float* aj = act + ulong(j) * ulong(ma.act_stride);
        for (uint c = lane; c < uint(a.in) / VPC; c += 32) {
            float xv[VPC];
            const float xsum = load_x_chunk<WF>(aj, c, xv);
            for (int i = 0; i < ROWS; i++)
                if (row0 + i < H) acc[i] += wj * chunk_dot<WF>(d, row0 + i, c, xv, xsum, a);
        }
    }
    for (int i = 0; i < ROWS; i++) {
        const float v = simd_sum(acc[i]);
        if (lane == 0 && row0 + i < H) x[row0 + i] += v;
    }
}

template [[host_name("moe_topk_j8")]] [[kernel]] decltype(moe_topk<8>) moe_topk<8>;
template [[host_name("moe_topk_j1")]] [[kernel]] decltype(moe_topk<1>) moe_topk<1>;
template [[host_name("moe_gate_up_decode_q4")]] [[kernel]] decltype(moe_gate_up_decode<WF_Q4, 4>) moe_gate_up_decode<WF_Q4, 4>;
template [[host_name("moe_gate_up_decode_bf16")]] [[kernel]] decltype(moe_gate_up_decode<WF_BF16, 4>) moe_gate_up_decode<WF_BF16, 4>;
template [[host_name("moe_down_decode_q4")]] [[kernel]] decltype(moe_down_decode<WF_Q4, 4>) moe_down_decode<WF_Q4, 4>;
template [[host_name("moe_down_decode_bf16")]] [[kernel]] decltype(moe_down_decode<WF_BF16, 4>) moe_down_decode<WF_BF16, 4>;
