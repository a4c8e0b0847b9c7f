// build: csrc/cuda/sample.cu
// Device sampler timing (sample.cuh: three launches) at the real vocab (248,320) for each kind of draw: greedy,
// temperature, top-k, top-p, the full set with penalties and bias, top-k + top-p at two k. A row of 3 N(0, 1) logits,
// 10% of tokens generated before (penalties), 5 biased ids. Correctness: tests/kernels/test_cuda_sample.py.
// Usage: time_sample [--once]
#include "cuda/sample.cuh"
#include "timing.cuh"

using namespace timing;
namespace ls = lily::cuda::sample;

namespace {

constexpr int kV = 248320;

struct Mode {
  const char* name;
  float T;  // 0: greedy
  int top_k;
  float top_p, min_p;
  bool penalties;
};

void time_mode(const Mode& m) {
  ls::Options opt;
  opt.greedy = m.T == 0.f;
  opt.inv_temperature = m.T == 0.f ? 1.f : 1.f / m.T;
  opt.top_k = m.top_k, opt.top_p = m.top_p, opt.min_p = m.min_p;
  opt.repetition_penalty = m.penalties ? 1.3f : 1.f;
  opt.presence_penalty = m.penalties ? 0.5f : 0.f, opt.frequency_penalty = m.penalties ? 0.3f : 0.f;
  opt.n_bias = m.penalties ? 5 : 0;
  std::vector<uint8_t> seen(kV);
  std::vector<int32_t> counts(kV);
  for (int i = 0; i < kV; ++i) counts[i] = i % 10 == 3 ? 1 + i % 3 : 0, seen[i] = counts[i] > 0 || i % 5 == 1;
  ls::Args a;
  a.logits = drandom<float>(kV, 5, -5.2f, 5.2f);  // uniform of N(0, 3)'s spread: the cut sizes of a real row
  a.x = dalloc<float>(kV);
  a.work = dalloc<float>(ls::workspace_floats(kV));
  a.opt = dupload(std::vector<ls::Options>{opt});
  a.bias_ids = dupload(std::vector<int32_t>{kV - 1, 0, 17, 4000, 123456});
  a.bias_vals = dupload(std::vector<float>{6.f, 3.f, -2.f, 1.5f, -4.f});
  a.seen = dupload(seen);
  a.counts = dupload(counts);
  a.uniform = dupload(std::vector<float>{0.37f});
  int32_t* token = dalloc<int32_t>(1);
  a.token = token;
  a.vocab = kV;
  // seen / counts drift as the draws record their tokens: harmless for the time
  const double ms = mean_ms([&](int) { ls::launch(nullptr, a); }, 200, 10);
  if (g_once) std::printf("ONCE sample %s\n", m.name);
  else std::printf("TIME sample %s V=%d: %.1f us\n", m.name, kV, ms * 1e3);
  for (const void* p : {static_cast<const void*>(a.logits), static_cast<const void*>(a.x),
                        static_cast<const void*>(a.work), static_cast<const void*>(a.opt),
                        static_cast<const void*>(a.bias_ids), static_cast<const void*>(a.bias_vals),
                        static_cast<const void*>(a.seen), static_cast<const void*>(a.counts),
                        static_cast<const void*>(a.uniform), static_cast<const void*>(token)})
    cudaFree(const_cast<void*>(p));
}

}  // namespace

int main(int argc, char** argv) {
  parse_args(argc, argv);
  print_device("time_sample");
  const Mode modes[] = {{"greedy", 0.f, 0, 1.f, 0.f, false}, {"temperature", 0.7f, 0, 1.f, 0.f, false},
                        {"top_k=20", 1.f, 20, 1.f, 0.f, false}, {"top_p=0.9", 1.f, 0, 0.9f, 0.f, false},
                        {"top_k+top_p+min_p+penalties", 0.7f, 50, 0.9f, 0.05f, true},
                        {"top_k=50+top_p=0.9", 0.7f, 50, 0.9f, 0.f, false},
                        {"top_k=250+top_p=0.9", 0.7f, 250, 0.9f, 0.f, false}};
  for (const Mode& m : modes) time_mode(m);
  return 0;
}
