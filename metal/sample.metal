// Sampling on the device: the logits row becomes the next token without leaving the GPU. The semantics are
// the CUDA sampler's and the host's (csrc/cuda/sample.cuh; twins: csrc/cpu/sample.cpp, lily.sampling.Sampler):
//   x = logits + bias; repetition penalty on `seen` tokens (x/rp if x > 0 else x*rp); x -= freq*count + pres on
//   generated tokens; greedy: argmax x (lowest index on ties); else w = exp((x - max x) / T), kept = top-k by x
//   (ties at the k-th value kept), then top-p on the kept (a value stays while the kept mass strictly above it is
//   < top_p of the kept mass; ties kept), then min-p (w >= min_p); the token is the first index (vocab order)
//   whose inclusive cumulative kept weight exceeds uniform * total. seen / counts record the drawn token.
//
// Three dispatches (sample_process, sample_weigh over the row in spans of kSampleSpan, one threadgroup
// sample_select), as on CUDA: the grid passes write the processed row, each span's max, sums and candidates
// (weight >= kSampleCandTau relative to the row max, compacted in vocab order); the final threadgroup finds
// the thresholds on the candidates alone when they provably hold the kept set (a language model's usual few
// hundred tokens), else on the whole row, and draws. Greedy skips sample_weigh.
//
// Every sum is fp32 in a fixed order (Metal has no double; a result must not depend on thread timing, and
// the emulator's three schedules require bit-identical outputs): each thread sums its own entries, then
// simdgroups in lane order, then simdgroup partials in index order. No float atomics: top-k counts by a
// radix histogram (integer atomics: order-free), top-p by a bitwise search for the cut key whose every probe
// is such a fixed-order sum. A draw can therefore differ from the float64 twins only within rounding of a
// CDF step (the tests' CDF_TOL rule, as for CUDA).
#include "common.h"

constant constexpr uint kSampleSpan = 2048;      // row entries per grid threadgroup (host: kSampleSpan too)
constant constexpr float kSampleCandTau = 1e-5f;  // candidate: weight >= this relative to the row max

// The scratch `work` (floats), for nb = ceil(V / kSampleSpan) spans: per-span partials, then the candidate
// lists (span b's at b * kSampleSpan, in vocab order), then the compacted list the final threadgroup uses.
struct SampleWork {
    device float* part_max;   // [nb] span max of x (NaN ignored)
    device int*   part_arg;   // [nb] its lowest index (>= V: the span has no value above -inf)
    device float* part_z;     // [nb] span sum of weights
    device float* part_keep;  // [nb] span sum of weights >= min_p
    device int*   part_cnt;   // [nb] candidates of the span
    device int*   part_off;   // [nb] where span b's candidates start in the list
    device float* cand_val;   // [nb * kSampleSpan]
    device int*   cand_idx;   // [nb * kSampleSpan]
    device float* list_val;   // [nb * kSampleSpan] all candidates, vocab order
    device int*   list_idx;   // [nb * kSampleSpan]
};

inline uint sample_spans(int V) { return (uint(V) + kSampleSpan - 1) / kSampleSpan; }

inline SampleWork sample_carve(device float* base, int V) {
    const ulong nb = sample_spans(V), cap = nb * kSampleSpan;
    SampleWork w;
    w.part_max = base;
    w.part_arg = (device int*)(base + nb);
    w.part_z = base + 2 * nb;
    w.part_keep = base + 3 * nb;
    w.part_cnt = (device int*)(base + 4 * nb);
    w.part_off = (device int*)(base + 5 * nb);
    w.cand_val = base + 6 * nb;
    w.cand_idx = (device int*)(base + 6 * nb + cap);
    w.list_val = base + 6 * nb + 2 * cap;
    w.list_idx = (device int*)(base + 6 * nb + 3 * cap);
    return w;
}

// Monotone map float -> uint (larger float, larger key); NaN maps to 0, -0 and +0 to one key (ties kept).
inline uint order_key(float v) {
    if (v != v) return 0u;
    if (v == 0.0f) return 0x80000000u;
    const uint b = as_type<uint>(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The weight of a processed logit relative to the row max m (NaN weighs nothing). Every kernel uses this one
// formula, so the spans' sums and the final threadgroup's agree.
inline float weight_of(float v, float m, float inv_t) { return v == v ? exp((v - m) * inv_t) : 0.0f; }

// Threadgroup sums in a fixed order; the result in every thread. tg: [32] scratch (free on entry).
inline float tg_sum(float v, threadgroup float* tg, uint sg, uint nsg, uint lane) {
    v = simd_sum(v);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lane == 0) tg[sg] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float t = 0.0f;
    for (uint j = 0; j < nsg; j++) t += tg[j];
    return t;
}

// Max with its lowest index over the threadgroup (NaN never wins); the result in every thread.
inline void tg_argmax(thread float& v, thread uint& i, threadgroup float* tv, threadgroup uint* ti, uint sg,
                      uint nsg, uint lane) {
    const float top = simd_max(v);
    const uint at = simd_min(v == top ? i : 0xffffffffu);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lane == 0) { tv[sg] = top; ti[sg] = at; }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    v = tv[0];
    i = ti[0];
    for (uint j = 1; j < nsg; j++)
        if (tv[j] > v || (tv[j] == v && ti[j] < i)) { v = tv[j]; i = ti[j]; }
}

// ---- grid pass 1: the processed logits of the span (bias, penalties), the span's max -----------------------
kernel void sample_process(device const float*  logits    [[buffer(0)]],   // [V] left unchanged
                           device float*        x         [[buffer(1)]],   // [V] out: processed logits
                           device float*        work      [[buffer(2)]],   // SampleWork
                           device const int*    bias_ids  [[buffer(3)]],   // [n_bias] distinct ids
                           device const float*  bias_vals [[buffer(4)]],   // [n_bias]
                           device const uchar*  seen      [[buffer(5)]],   // [V] prompt or generated
                           device const int*    counts    [[buffer(6)]],   // [V] generated counts
                           constant kp::SampleArgs& sa    [[buffer(7)]],
                           uint b    [[threadgroup_position_in_grid]],
                           uint tid  [[thread_index_in_threadgroup]],
                           uint nt   [[threads_per_threadgroup]],
                           uint sg   [[simdgroup_index_in_threadgroup]],
                           uint nsg  [[simdgroups_per_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]])
{
    threadgroup float tg_x[kSampleSpan];
    threadgroup float tg_v[32];
    threadgroup uint tg_i[32];
    const SampleWork wk = sample_carve(work, sa.vocab);
    const uint V = uint(sa.vocab), lo = b * kSampleSpan, hi = min(V, lo + kSampleSpan);
    for (uint i = lo + tid; i < hi; i += nt) tg_x[i - lo] = logits[i];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // bias before the penalties (the host sampler's order); each threadgroup applies the entries of its span
    for (uint j = tid; j < uint(sa.n_bias); j += nt) {
        const uint id = uint(bias_ids[j]);
        if (id >= lo && id < hi) tg_x[id - lo] += bias_vals[j];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const bool rep = sa.repetition_penalty != 1.0f, cnt = sa.presence_penalty != 0.0f || sa.frequency_penalty != 0.0f;
    float m = -INFINITY;
    uint am = 0xffffffffu;
    for (uint i = lo + tid; i < hi; i += nt) {
        float v = tg_x[i - lo];
        if (rep && seen[i]) v = v > 0.0f ? v / sa.repetition_penalty : v * sa.repetition_penalty;
        if (cnt) {
            const int c = counts[i];
            if (c > 0) v -= sa.frequency_penalty * float(c) + sa.presence_penalty;
        }
        x[i] = v;
        if (v > m) { m = v; am = i; }  // ascending i per thread: the first of equal values stays; NaN never wins
    }
    tg_argmax(m, am, tg_v, tg_i, sg, nsg, lane);
    if (tid == 0) { wk.part_max[b] = m; wk.part_arg[b] = int(am); }
}

// ---- grid pass 2: weights against the row max; span sums; the span's candidates, compacted in vocab order ---
kernel void sample_weigh(device const float*  x    [[buffer(0)]],   // [V] processed logits
                         device float*        work [[buffer(1)]],   // SampleWork
                         constant kp::SampleArgs& sa [[buffer(2)]],
                         uint b    [[threadgroup_position_in_grid]],
                         uint tid  [[thread_index_in_threadgroup]],
                         uint nt   [[threads_per_threadgroup]],
                         uint sg   [[simdgroup_index_in_threadgroup]],
                         uint nsg  [[simdgroups_per_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]])
{
    threadgroup float tg_f[32];
    threadgroup uint tg_n[32];
    const SampleWork wk = sample_carve(work, sa.vocab);
    const uint V = uint(sa.vocab), nb = sample_spans(sa.vocab), lo = b * kSampleSpan, hi = min(V, lo + kSampleSpan);
    float m = -INFINITY;
    for (uint j = tid; j < nb; j += nt) m = max(m, wk.part_max[j]);
    m = simd_max(m);
    if (lane == 0) tg_f[sg] = m;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint j = 0; j < nsg; j++) m = max(m, tg_f[j]);
    const float it = sa.inv_temperature, min_w = sa.min_p;
    const bool any = m > -INFINITY;
    float z = 0.0f, keep = 0.0f;
    uint base = 0;  // candidates written so far
    for (uint i0 = lo; i0 < hi; i0 += nt) {
        const uint i = i0 + tid;
        const float v = i < hi ? x[i] : -INFINITY;
        const float w = i < hi && any ? weight_of(v, m, it) : 0.0f;
        z += w;
        keep += w >= min_w ? w : 0.0f;
        const uint c = w >= kSampleCandTau ? 1u : 0u;
        const uint before_lane = simd_prefix_exclusive_sum(c), in_sg = simd_sum(c);
        threadgroup_barrier(mem_flags::mem_threadgroup);  // tg_f / tg_n of the previous round were read
        if (lane == 0) tg_n[sg] = in_sg;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        uint before = base, total = 0;
        for (uint j = 0; j < nsg; j++) {
            if (j < sg) before += tg_n[j];
            total += tg_n[j];
        }
        if (c) {
            const uint at = lo + before + before_lane;
            wk.cand_val[at] = v;
            wk.cand_idx[at] = int(i);
        }
        base += total;
    }
    z = tg_sum(z, tg_f, sg, nsg, lane);
    keep = tg_sum(keep, tg_f, sg, nsg, lane);
    if (tid == 0) {
        wk.part_z[b] = z;
        wk.part_keep[b] = keep;
        wk.part_cnt[b] = int(base);
    }
}

// The kept weight of position i of `vals`: key >= keep_key, then weight >= min_p (else 0).
struct KeptWeight {
    device const float* vals;
    float m, inv_t, min_p;
    uint keep_key;
    float operator()(uint i) const {
        const float v = vals[i];
        if (order_key(v) < keep_key) return 0.0f;
        const float e = weight_of(v, m, inv_t);
        return e >= min_p ? e : 0.0f;
    }
};

// The draw over positions [lo, hi) by the whole threadgroup: target = u * (kept total) when from_u, else rem.
// Each thread owns a contiguous run of positions; the simdgroup, then the lane, then the position whose
// inclusive cumulative kept weight first exceeds the target is chosen in that fixed order (fp32). Past the
// end by rounding: the last kept position of the chosen run. Returns the position (every thread), -1 when
// nothing is kept. tg_f: [33] and tg_i: [2] scratch.
inline int tg_draw(KeptWeight kw, uint lo, uint hi, float u, float rem_in, bool from_u, threadgroup float* tg_f,
                   threadgroup int* tg_i, uint tid, uint nt, uint sg, uint nsg, uint lane)
{
    const uint per = (hi - lo + nt - 1) / nt;
    const uint c0 = min(hi, lo + tid * per), c1 = min(hi, c0 + per);
    float part = 0.0f;
    for (uint i = c0; i < c1; i++) part += kw(i);
    const float incl = simd_prefix_inclusive_sum(part);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lane == 31) tg_f[sg] = incl;  // the simdgroup's total, as its lanes' prefix sums see it
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
        float total = 0.0f;
        for (uint j = 0; j < nsg; j++) total += tg_f[j];
        const float target = from_u ? u * total : rem_in;
        float before = 0.0f, before_c = 0.0f;
        int c = -1;
        for (uint j = 0; j < nsg; j++) {
            const float wj = tg_f[j];
            if (!(wj > 0.0f)) continue;
            c = int(j);
            before_c = before;
            if (before + wj > target) break;
            before += wj;
        }
        tg_i[0] = c;
        tg_i[1] = -1;
        tg_f[32] = target - before_c;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int chosen = tg_i[0];
    if (int(sg) == chosen) {
        const float rem = tg_f[32];
        const uint hit = simd_min(part > 0.0f && incl > rem ? lane : 0xffffffffu);
        const uint last = simd_max(part > 0.0f ? lane : 0u);
        const uint pick = hit != 0xffffffffu ? hit : last;
        if (lane == pick) {
            const float r = rem - (incl - part);
            float run = 0.0f;
            int pos = -1, kept = -1;
            for (uint i = c0; i < c1; i++) {
                const float e = kw(i);
                if (!(e > 0.0f)) continue;
                kept = int(i);
                run += e;
                if (run > r) { pos = int(i); break; }
            }
            tg_i[1] = pos >= 0 ? pos : kept;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    return tg_i[1];
}

// ---- the final threadgroup: thresholds on the candidates (or the whole row), the draw, seen / counts --------
kernel void sample_select(device const float*  x       [[buffer(0)]],   // [V] processed logits
                          device float*        work    [[buffer(1)]],   // SampleWork
                          device uchar*        seen    [[buffer(2)]],   // [V] updated with the draw
                          device int*          counts  [[buffer(3)]],   // [V] updated with the draw
                          device const float*  uniform [[buffer(4)]],   // [1] this step's draw in [0, 1)
                          device int*          tokens  [[buffer(5)]],   // out: tokens[sa.token_slot]
                          constant kp::SampleArgs& sa  [[buffer(6)]],
                          uint tid  [[thread_index_in_threadgroup]],
                          uint nt   [[threads_per_threadgroup]],
                          uint sg   [[simdgroup_index_in_threadgroup]],
                          uint nsg  [[simdgroups_per_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]])
{
    threadgroup float tg_f[33];
    threadgroup uint tg_u[32];
    threadgroup int tg_i[4];
    threadgroup atomic_int tg_hist[256];
    const SampleWork wk = sample_carve(work, sa.vocab);
    const int V = sa.vocab;
    const uint nb = sample_spans(V);

    float m = -INFINITY;
    uint am = 0xffffffffu;
    for (uint j = tid; j < nb; j += nt) {
        const float pm = wk.part_max[j];
        const uint pa = uint(wk.part_arg[j]);
        if (pm > m || (pm == m && pa < am)) { m = pm; am = pa; }
    }
    tg_argmax(m, am, tg_f, tg_u, sg, nsg, lane);
    if (am >= uint(V)) am = 0;  // every entry NaN or -inf: token 0, as an argmax of such a row

    int token = int(am);
    if (!sa.greedy && m > -INFINITY) {
        const float it = sa.inv_temperature, u = uniform[0];
        const bool topk = sa.top_k > 0 && sa.top_k < V, topp = sa.top_p < 1.0f;
        if (!topk && !topp) {
            // every token with weight >= min_p is kept: the spans' sums pick the span, the threadgroup walks it
            if (tid == 0) {
                float total = 0.0f;
                for (uint j = 0; j < nb; j++) total += wk.part_keep[j];
                const float target = u * total;
                float before = 0.0f, before_c = 0.0f;
                int c = -1;
                for (uint j = 0; j < nb; j++) {
                    const float wj = wk.part_keep[j];
                    if (!(wj > 0.0f)) continue;
                    c = int(j);
                    before_c = before;
                    if (before + wj > target) break;
                    before += wj;
                }
                tg_i[2] = c;
                tg_f[32] = target - before_c;
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
            const int c = tg_i[2];
            const float rem = tg_f[32];
            threadgroup_barrier(mem_flags::mem_threadgroup);  // tg_draw reuses tg_f / tg_i
            if (c >= 0) {
                const uint lo = uint(c) * kSampleSpan, hi = min(uint(V), lo + kSampleSpan);
                const int pos = tg_draw(KeptWeight{x, m, it, sa.min_p, 0u}, lo, hi, u, rem, false, tg_f, tg_i, tid,
                                        nt, sg, nsg, lane);
                if (pos >= 0) token = pos;
            }
        } else {
            // The candidates (weight >= kSampleCandTau) are a top set of the row by value: they hold the kept
            // set when they hold top-k's k tokens, or (top-p alone) top_p of the row's mass.
            if (tid == 0) {
                int off = 0;
                for (uint j = 0; j < nb; j++) {
                    wk.part_off[j] = off;
                    off += wk.part_cnt[j];
                }
                tg_i[3] = off;
            }
            threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);
            const int c_total = tg_i[3];
            bool use_list = !topk || c_total >= sa.top_k;
            float zp = 0.0f;
            for (uint j = tid; j < nb; j += nt) zp += wk.part_z[j];
            const float z_all = tg_sum(zp, tg_f, sg, nsg, lane);
            if (use_list) {
                for (uint j = 0; j < nb; j++) {
                    const uint c = uint(wk.part_cnt[j]), off = uint(wk.part_off[j]);
                    for (uint q = tid; q < c; q += nt) {
                        wk.list_val[off + q] = wk.cand_val[j * kSampleSpan + q];
                        wk.list_idx[off + q] = wk.cand_idx[j * kSampleSpan + q];
                    }
                }
                threadgroup_barrier(mem_flags::mem_device);  // the list is read by other threads below
                if (topp && !topk) {
                    float lm = 0.0f;
                    for (uint q = tid; q < uint(c_total); q += nt) lm += weight_of(wk.list_val[q], m, it);
                    lm = tg_sum(lm, tg_f, sg, nsg, lane);
                    use_list = lm >= sa.top_p * z_all * (1.0f + 1e-4f);
                }
            }
            const uint n = use_list ? uint(c_total) : uint(V);
            device const float* vals = use_list ? wk.list_val : x;

            // top-k: the key of the k-th largest value, 8 bits per pass (integer counts: order-free)
            uint kk = 0;  // keep keys >= kk
            if (sa.top_k > 0 && uint(sa.top_k) < n) {
                uint prefix = 0, mask = 0;
                int need = sa.top_k;
                for (int shift = 24; shift >= 0; shift -= 8) {
                    for (uint j = tid; j < 256; j += nt) atomic_store_explicit(&tg_hist[j], 0, memory_order_relaxed);
                    threadgroup_barrier(mem_flags::mem_threadgroup);
                    for (uint i = tid; i < n; i += nt) {
                        const uint key = order_key(vals[i]);
                        if ((key & mask) == prefix)
                            atomic_fetch_add_explicit(&tg_hist[(key >> uint(shift)) & 255u], 1, memory_order_relaxed);
                    }
                    threadgroup_barrier(mem_flags::mem_threadgroup);
                    int bin = 255;
                    for (; bin > 0; --bin) {
                        const int h = atomic_load_explicit(&tg_hist[bin], memory_order_relaxed);
                        if (need <= h) break;
                        need -= h;
                    }
                    prefix |= uint(bin) << uint(shift);
                    mask |= 255u << uint(shift);
                    threadgroup_barrier(mem_flags::mem_threadgroup);  // every thread read the histogram
                }
                kk = prefix;
            }

            // top-p over the kept: the smallest key K whose kept mass strictly above is < top_p * kept mass,
            // bit by bit (the mass above K only falls as K grows); each probe a fixed-order sum
            uint kp = 0;
            if (topp) {
                float z;
                if (use_list && !topk) {
                    z = z_all;  // the row's mass: the list alone does not hold it
                } else {
                    float s = 0.0f;
                    for (uint i = tid; i < n; i += nt)
                        if (order_key(vals[i]) >= kk) s += weight_of(vals[i], m, it);
                    z = tg_sum(s, tg_f, sg, nsg, lane);
                }
                const float target = sa.top_p * z;
                uint key_cut = 0;
                for (int bit = 31; bit >= 0; --bit) {
                    const uint probe = key_cut | ((1u << uint(bit)) - 1u);
                    float s = 0.0f;
                    for (uint i = tid; i < n; i += nt) {
                        const uint key = order_key(vals[i]);
                        if (key >= kk && key > probe) s += weight_of(vals[i], m, it);
                    }
                    const float above = tg_sum(s, tg_f, sg, nsg, lane);
                    if (!(above < target)) key_cut |= 1u << uint(bit);
                }
                kp = key_cut;
            }
            // the row's largest value is always kept (a degenerate top_p * mass of 0 keeps it alone)
            const uint keep_key = min(max(kk, kp), order_key(m));
            threadgroup_barrier(mem_flags::mem_threadgroup);  // tg_draw reuses tg_f / tg_i
            const int pos = tg_draw(KeptWeight{vals, m, it, sa.min_p, keep_key}, 0, n, u, 0.0f, true, tg_f, tg_i,
                                    tid, nt, sg, nsg, lane);
            if (pos >= 0) token = use_list ? wk.list_idx[pos] : pos;
        }
    }
    if (tid == 0) {
        tokens[sa.token_slot] = token;
        seen[token] = 1;
        counts[token] += 1;
    }
}
