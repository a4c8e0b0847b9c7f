// CPU runtime for MSL-as-C++ kernels: one fiber per GPU thread, simdgroups of 32 lanes.
// A fiber runs until it reaches a sync point (simd_* collective, simdgroup_matrix op, simdgroup or
// threadgroup barrier) or exits. When every fiber of the threadgroup is blocked, the scheduler resolves
// pending simd collectives (lowest source line first within a simdgroup = reconvergence heuristic;
// simdgroups skewed or in lockstep depending on the schedule), then threadgroup barriers. Running each thread to its next sync point is adversarial for missing barriers;
// running the same dispatch in forward, reverse and shuffled order (threads and threadgroups) and
// comparing outputs exposes races. Threadgroup memory is poisoned (0xFF bytes = NaN) per threadgroup.
#include "../include/msl_rt_api.h"
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#if !defined(MSL_UCONTEXT) && defined(__x86_64__)
// x86-64 SysV context switch (callee-saved registers + stack pointer); far cheaper than swapcontext,
// which also saves/restores the signal mask with a system call.
extern "C" void msl_ctx_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl msl_ctx_switch
.type msl_ctx_switch,@function
msl_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size msl_ctx_switch, .-msl_ctx_switch
)");
#define MSL_FAST_SWITCH 1
#endif

namespace {
enum class St { Runnable, AtSimd, AtBarrier, Done };
struct Fiber {
  ucontext_t ctx;
  void* sp = nullptr;
  char* stack = nullptr;
  msl_thread_ctx tc;
  St st = St::Done;
  unsigned line = 0;
  const void* in = nullptr;
  void* out = nullptr;
  msl_combine_fn fn = nullptr;
};
struct Shared {  // per dispatch
  std::mutex mu;
  std::set<std::string> diags;
  std::atomic<unsigned> next_tg{0};
  std::vector<unsigned> tg_order;
  std::atomic<unsigned long> switches{0}, collectives{0}, barriers{0}, divergent{0};
};
const size_t kStack = 64 * 1024, kGuard = 4096;
const unsigned long kTgLimit = 32768;  // Apple GPUs: 32 KiB of threadgroup memory per threadgroup
std::atomic<unsigned> g_epoch{1};

// Fiber stacks are reused across dispatches (a model run issues thousands of dispatches).
std::mutex g_stack_mu;
std::vector<char*> g_stacks;
char* take_stack() {
  {
    std::lock_guard<std::mutex> g(g_stack_mu);
    if (!g_stacks.empty()) { char* s = g_stacks.back(); g_stacks.pop_back(); return s; }
  }
  char* s = (char*)mmap(nullptr, kStack + kGuard, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  mprotect(s, kGuard, PROT_NONE);  // stack overflow -> SIGSEGV instead of silent corruption
  return s;
}
void give_stack(char* s) { std::lock_guard<std::mutex> g(g_stack_mu); g_stacks.push_back(s); }

struct Runner {  // one per OS thread
  std::vector<Fiber> f;
  ucontext_t sched;
  void* sched_sp = nullptr;
  Fiber* cur = nullptr;
  msl_launch_fn launch = nullptr;
  void** buffers = nullptr;
  std::vector<std::vector<unsigned char>> tgmem;
  std::vector<void*> tgptr;
  unsigned long tg_dynamic = 0, tg_bytes = 0;
  unsigned epoch = 0;
  Shared* sh = nullptr;
  unsigned long switches = 0, collectives = 0, barriers = 0, divergent = 0;
  std::vector<unsigned> seg_live;  // per simdgroup: lanes live at its last sync point
  std::vector<unsigned> sg_order;
  ~Runner() { for (auto& x : f) if (x.stack) give_stack(x.stack); }
  void diag(const std::string& s) { std::lock_guard<std::mutex> g(sh->mu); sh->diags.insert(s); }
};
thread_local Runner* g_run = nullptr;

void fiber_main(int idx) {
  Runner* r = g_run;
  r->launch(r->buffers, r->tgptr.data());
  r->f[idx].st = St::Done;
}  // ucontext: uc_link returns to the scheduler

#ifdef MSL_FAST_SWITCH
void fiber_entry() {
  Runner* r = g_run;
  fiber_main((int)(r->cur - r->f.data()));
  msl_ctx_switch(&r->cur->sp, r->sched_sp);  // never resumed
  __builtin_unreachable();
}
#endif

void yield() {
  Runner* r = g_run;
#ifdef MSL_FAST_SWITCH
  msl_ctx_switch(&r->cur->sp, r->sched_sp);
#else
  swapcontext(&r->cur->ctx, &r->sched);
#endif
}

void init_fiber(Runner& r, unsigned i, const unsigned tg[3], const unsigned grid[3], const unsigned ts[3], unsigned nsg) {
  Fiber& x = r.f[i];
  msl_thread_ctx& c = x.tc;
  unsigned loc[3] = {i % ts[0], (i / ts[0]) % ts[1], i / (ts[0] * ts[1])};
  for (int d = 0; d < 3; d++) {
    c.thread_position_in_threadgroup[d] = loc[d];
    c.threadgroup_position_in_grid[d] = tg[d];
    c.threads_per_threadgroup[d] = ts[d];
    c.threadgroups_per_grid[d] = grid[d];
    c.threads_per_grid[d] = grid[d] * ts[d];
    c.thread_position_in_grid[d] = tg[d] * ts[d] + loc[d];
  }
  c.thread_index_in_threadgroup = i;
  c.thread_index_in_simdgroup = c.lane = i % 32;
  c.simdgroup_index_in_threadgroup = i / 32;
  c.threads_per_simdgroup = 32;
  c.simdgroups_per_threadgroup = nsg;
#ifdef MSL_FAST_SWITCH
  void** top = (void**)(((unsigned long)(x.stack + kGuard + kStack)) & ~15ul);
  top[-1] = nullptr;                 // fake return address of fiber_entry
  top[-2] = (void*)&fiber_entry;     // popped by msl_ctx_switch's ret
  for (int k = 3; k <= 8; k++) top[-k] = nullptr;  // rbp rbx r12-r15
  x.sp = top - 8;
#else
  getcontext(&x.ctx);
  x.ctx.uc_stack.ss_sp = x.stack + kGuard;
  x.ctx.uc_stack.ss_size = kStack;
  x.ctx.uc_link = &r.sched;
  makecontext(&x.ctx, (void (*)())fiber_main, 1, (int)i);
#endif
  x.st = St::Runnable;
}

// Resolves the pending collective of simdgroup s with the lowest source line (reconvergence heuristic);
// returns false if none is pending. Strict rule: the participants must be every lane that was live when
// the simdgroup last synchronised (seg_live); a lane that exited in between skipped the collective.
bool resolve_sg(Runner& r, unsigned s, unsigned T) {
  const unsigned lo = s * 32, hi = std::min(T, lo + 32), live = r.seg_live[s];
  unsigned best = ~0u;
  for (unsigned i = lo; i < hi; i++)
    if (r.f[i].st == St::AtSimd) best = std::min(best, r.f[i].line);
  if (best == ~0u) return false;
  const void* ins[32] = {nullptr};
  unsigned mask = 0;
  for (unsigned i = lo; i < hi; i++)
    if (r.f[i].st == St::AtSimd && r.f[i].line == best) { mask |= 1u << (i - lo); ins[i - lo] = r.f[i].in; }
  if (mask != live) {
    r.divergent++;
    char b[220];
    snprintf(b, sizeof b, "ERROR line %u: simdgroup collective reached by lanes 0x%08x of live lanes 0x%08x "
             "(divergent control flow)", best, mask, live);
    r.diag(b);
  }
  for (unsigned i = lo; i < hi; i++) {
    Fiber& x = r.f[i];
    if (!(mask >> (i - lo) & 1u)) continue;
    if (x.fn) x.fn(ins, mask, i - lo, x.out);
    x.st = St::Runnable;
  }
  r.seg_live[s] = 0;
  for (unsigned i = lo; i < hi; i++) if (r.f[i].st != St::Done) r.seg_live[s] |= 1u << (i - lo);
  r.collectives++;
  return true;
}

void run_fiber(Runner& r, Fiber& x) {
  r.cur = &x;
#ifdef MSL_FAST_SWITCH
  msl_ctx_switch(&r.sched_sp, x.sp);
#else
  swapcontext(&r.sched, &x.ctx);
#endif
  r.switches++;
}

// One step of the skewed schedules (0: simdgroup 0 first, 1: last first): the first simdgroup in priority
// order that can move runs its lanes to their next sync point, or has its collective resolved. That
// simdgroup therefore runs ahead, alone, until it blocks at a threadgroup barrier or exits, which exposes
// a missing barrier between threadgroup-memory writes by one simdgroup and reads by another.
bool step_skewed(Runner& r, unsigned T, unsigned nsg, int sched) {
  for (unsigned k = 0; k < nsg; k++) {
    const unsigned s = sched == 1 ? nsg - 1 - k : k;
    const unsigned lo = s * 32, hi = std::min(T, lo + 32);
    bool ran = false;
    for (unsigned j = lo; j < hi; j++) {
      const unsigned i = sched == 1 ? hi - 1 - (j - lo) : j;
      if (r.f[i].st == St::Runnable) { run_fiber(r, r.f[i]); ran = true; }
    }
    if (ran || resolve_sg(r, s, T)) return true;
  }
  return false;
}

// One step of the lockstep schedule (2): every runnable thread in a shuffled order, then one collective
// per simdgroup, simdgroups in a shuffled order.
bool step_lockstep(Runner& r, unsigned T, unsigned nsg, std::vector<unsigned>& order, std::mt19937& rng) {
  std::shuffle(order.begin(), order.end(), rng);
  for (unsigned i : order)
    if (r.f[i].st == St::Runnable) run_fiber(r, r.f[i]);
  std::vector<unsigned>& sgs = r.sg_order;
  sgs.resize(nsg);
  for (unsigned s = 0; s < nsg; s++) sgs[s] = s;
  std::shuffle(sgs.begin(), sgs.end(), rng);
  bool progress = false;
  for (unsigned s : sgs) progress |= resolve_sg(r, s, T);
  return progress;
}

void run_threadgroup(Runner& r, const unsigned tg[3], const unsigned grid[3], const unsigned ts[3], int sched,
                     std::mt19937& rng) {
  const unsigned T = ts[0] * ts[1] * ts[2];
  const unsigned nsg = (T + 31) / 32;
  r.epoch = g_epoch.fetch_add(1);
  r.tg_bytes = r.tg_dynamic;
  for (auto& m : r.tgmem) std::memset(m.data(), 0xFF, m.size());
  for (unsigned i = 0; i < T; i++) init_fiber(r, i, tg, grid, ts, nsg);
  r.seg_live.assign(nsg, 0);
  for (unsigned i = 0; i < T; i++) r.seg_live[i / 32] |= 1u << (i % 32);
  std::vector<unsigned> order(T);
  for (unsigned i = 0; i < T; i++) order[i] = i;
  for (;;) {
    if (sched == 2 ? step_lockstep(r, T, nsg, order, rng) : step_skewed(r, T, nsg, sched)) continue;
    unsigned live = 0, at_bar = 0;
    std::set<unsigned> lines;
    for (unsigned i = 0; i < T; i++) {
      if (r.f[i].st == St::Done) continue;
      live++;
      if (r.f[i].st == St::AtBarrier) { at_bar++; lines.insert(r.f[i].line); }
    }
    if (live == 0) break;
    if (at_bar == live) {
      if (lines.size() > 1) {
        std::string s = "ERROR: threads of one threadgroup wait at different threadgroup_barrier calls (lines";
        for (unsigned l : lines) s += " " + std::to_string(l);
        r.diag(s + ")");
      }
      if (live < T) {
        char b[200];
        snprintf(b, sizeof b, "ERROR line %u: threadgroup_barrier reached after %u of %u threads exited "
                 "(undefined in MSL)", *lines.begin(), T - live, T);
        r.diag(b);
      }
      for (unsigned i = 0; i < T; i++) if (r.f[i].st == St::AtBarrier) r.f[i].st = St::Runnable;
      for (unsigned s = 0; s < nsg; s++) {
        r.seg_live[s] = 0;
        for (unsigned i = s * 32; i < std::min(T, s * 32 + 32); i++)
          if (r.f[i].st != St::Done) r.seg_live[s] |= 1u << (i % 32);
      }
      r.barriers++;
      continue;
    }
    r.diag("ERROR: deadlock: no runnable thread, no resolvable collective or barrier");
    break;
  }
}
}  // namespace

extern "C" {
const msl_thread_ctx* msl_rt_ctx(void) { return &g_run->cur->tc; }

void msl_rt_simd_collective(const void* in, void* out, msl_combine_fn fn, unsigned line) {
  Fiber* x = g_run->cur;
  x->in = in; x->out = out; x->fn = fn; x->line = line; x->st = St::AtSimd;
  yield();
}
void msl_rt_simd_sync(unsigned line) {
  Fiber* x = g_run->cur;
  x->in = nullptr; x->out = nullptr; x->fn = nullptr; x->line = line; x->st = St::AtSimd;
  yield();
}
void msl_rt_barrier(unsigned, unsigned line) {
  Fiber* x = g_run->cur;
  x->line = line; x->st = St::AtBarrier;
  yield();
}
void msl_rt_report(const char* msg) { g_run->diag(std::string("ERROR: ") + msg); }
void msl_rt_tg_poison(void* p, unsigned long n, unsigned* epoch) {
  Runner* r = g_run;
  if (*epoch == r->epoch) return;
  std::memset(p, 0xFF, n);
  *epoch = r->epoch;
  r->tg_bytes += n;
  if (r->tg_bytes > kTgLimit) {
    char b[160];
    snprintf(b, sizeof b, "ERROR: threadgroup memory %lu bytes exceeds the %lu-byte limit", r->tg_bytes, kTgLimit);
    r->diag(b);
  }
}

int msl_dispatch(msl_launch_fn fn, const unsigned grid[3], const unsigned ts[3], void** buffers,
                 const unsigned long* tg_sizes, int n_tg, int sched, unsigned seed, int nthreads,
                 char* msg, int msg_len, double* stats) {
  Shared sh;
  const unsigned T = ts[0] * ts[1] * ts[2];
  const unsigned ntg = grid[0] * grid[1] * grid[2];
  if (T == 0 || T > 1024) { snprintf(msg, msg_len, "ERROR: threads per threadgroup %u not in 1..1024", T); return 1; }
  sh.tg_order.resize(ntg);
  for (unsigned i = 0; i < ntg; i++) sh.tg_order[i] = sched == 1 ? ntg - 1 - i : i;
  if (sched == 2) { std::mt19937 g(seed * 31u + 7u); std::shuffle(sh.tg_order.begin(), sh.tg_order.end(), g); }
  auto t0 = std::chrono::steady_clock::now();
  auto worker = [&](int wi) {
    Runner r;
    r.sh = &sh; r.launch = fn; r.buffers = buffers;
    r.f.resize(T);
    for (auto& x : r.f) x.stack = take_stack();
    for (int i = 0; i < n_tg; i++) { r.tgmem.emplace_back(tg_sizes[i]); r.tg_dynamic += tg_sizes[i]; }
    for (auto& m : r.tgmem) r.tgptr.push_back(m.data());
    r.tgptr.push_back(nullptr);
    g_run = &r;
    std::mt19937 rng(seed * 7919u + (unsigned)wi);
    for (;;) {
      unsigned k = sh.next_tg.fetch_add(1);
      if (k >= ntg) break;
      unsigned t = sh.tg_order[k];
      unsigned tg[3] = {t % grid[0], (t / grid[0]) % grid[1], t / (grid[0] * grid[1])};
      run_threadgroup(r, tg, grid, ts, sched, rng);
    }
    sh.switches += r.switches; sh.collectives += r.collectives; sh.barriers += r.barriers; sh.divergent += r.divergent;
    g_run = nullptr;
  };
  if (nthreads <= 1 || ntg == 1) worker(0);
  else {
    std::vector<std::thread> th;
    for (int i = 0; i < nthreads && i < (int)ntg; i++) th.emplace_back(worker, i);
    for (auto& t : th) t.join();
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string all;
  for (auto& d : sh.diags) all += d + "\n";
  snprintf(msg, msg_len, "%s", all.c_str());
  if (stats) {
    stats[0] = secs; stats[1] = (double)ntg * T; stats[2] = (double)sh.switches; stats[3] = (double)sh.collectives;
    stats[4] = (double)sh.barriers; stats[5] = (double)sh.divergent;
  }
  return (int)sh.diags.size();
}
}
