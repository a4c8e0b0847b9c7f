// C ABI between a kernel translation unit (compiled -nostdinc against metal_stdlib) and the CPU
// runtime (rt/msl_rt.cpp, built once as libmsl_rt.so and shared by every kernel library).
#pragma once
#ifdef __cplusplus
extern "C" {
#endif
struct msl_thread_ctx {
  unsigned thread_position_in_grid[3], thread_position_in_threadgroup[3], threadgroup_position_in_grid[3];
  unsigned threads_per_threadgroup[3], threadgroups_per_grid[3], threads_per_grid[3];
  unsigned thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  unsigned threads_per_simdgroup, simdgroups_per_threadgroup, lane;
};
const struct msl_thread_ctx* msl_rt_ctx(void);
// A sync point of the lanes of one simdgroup; every live lane must reach the same call.
void msl_rt_simd_sync(unsigned line);
void msl_rt_barrier(unsigned flags, unsigned line);
// Kernel-scope threadgroup storage: poisoned (0xFF bytes = NaN) once per threadgroup, size-checked.
void msl_rt_tg_poison(void* p, unsigned long n, unsigned* epoch);
void* msl_tg_region(void);  /* check-as mode only: stands in for kernel-scope threadgroup storage */
#ifndef __OPENCL_CPP_VERSION__
void msl_rt_report(const char* msg);
// combine(in[32] = each lane's input (NULL if inactive), active mask, this lane, out) -> per-lane result
typedef void (*msl_combine_fn)(const void* const* in, unsigned mask, unsigned lane, void* out);
void msl_rt_simd_collective(const void* in, void* out, msl_combine_fn fn, unsigned line);
typedef void (*msl_launch_fn)(void** buffers, void** tg_buffers);
// Runs a whole dispatch. sched: 0 = forward, 1 = reverse, 2 = seeded shuffle (thread order per resume
// round and threadgroup order). Returns the number of distinct diagnostics (text in msg).
// stats: secs, threads, switches, collectives, barriers, divergent.
int msl_dispatch(msl_launch_fn fn, const unsigned grid_tgs[3], const unsigned tg_size[3], void** buffers,
                 const unsigned long* tg_buffer_sizes, int n_tg_buffers, int sched, unsigned seed, int nthreads,
                 char* msg, int msg_len, double* stats);
#endif
#ifdef __cplusplus
}
#endif
