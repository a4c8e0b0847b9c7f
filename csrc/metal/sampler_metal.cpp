#include "metal/sampler_metal.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>

namespace lily::metal {
namespace {

constexpr uint32_t kSampleGridThreads = 256;     // sample_process / sample_weigh: 8 entries of a span each
constexpr uint32_t kSampleSelectThreads = 1024;  // sample_select: one threadgroup, as wide as the device allows

uint32_t spans(int V) { return static_cast<uint32_t>((V + Ops::kSampleSpan - 1) / Ops::kSampleSpan); }

// Threads of a pipeline: at most `want`, a multiple of 32 within the device's limit for it.
uint32_t threads_for(Device& dev, Pipeline* p, uint32_t want) {
  return std::max<uint32_t>(32, std::min<uint32_t>(want, dev.max_threads(p) / 32 * 32));
}

}  // namespace

size_t Ops::sample_work_bytes(int V) {
  const size_t nb = spans(V);
  return (6 * nb + 4 * nb * static_cast<size_t>(kSampleSpan)) * sizeof(float);  // sample.metal SampleWork
}

void Ops::sample(Encoder& e, const kp::SampleArgs& a, const SampleBufs& b) {
  if (a.vocab < 1) throw std::invalid_argument("[lily] metal: device sampler over an empty vocab");
  const uint32_t nb = spans(a.vocab);
  auto args = [&](int i) { e.set_bytes(i, &a, sizeof a); };
  BufRef process[] = {b.logits, b.x, b.work, b.bias_ids, b.bias_vals, b.seen, b.counts};
  for (int i = 0; i < 7; ++i) e.set_buffer(i, process[i]);
  args(7);
  go(e, "sample_process", {nb, 1, 1}, {threads_for(dev_, pipe("sample_process"), kSampleGridThreads), 1, 1});
  e.barrier();
  if (!a.greedy) {  // the argmax needs no weights
    e.set_buffer(0, b.x);
    e.set_buffer(1, b.work);
    args(2);
    go(e, "sample_weigh", {nb, 1, 1}, {threads_for(dev_, pipe("sample_weigh"), kSampleGridThreads), 1, 1});
    e.barrier();
  }
  BufRef select[] = {b.x, b.work, b.seen, b.counts, b.uniform, b.tokens};
  for (int i = 0; i < 6; ++i) e.set_buffer(i, select[i]);
  args(6);
  go(e, "sample_select", {1, 1, 1}, {threads_for(dev_, pipe("sample_select"), kSampleSelectThreads), 1, 1});
}

MetalSampler::MetalSampler(Device& dev, int32_t vocab) : dev_(dev), V_(vocab) {
  if (vocab < 1) throw std::invalid_argument("[lily] metal: device sampler over an empty vocab");
  x_ = make(static_cast<size_t>(vocab) * 4);
  work_ = make(Ops::sample_work_bytes(vocab));
  seen_ = make(static_cast<size_t>(vocab));
  counts_ = make(static_cast<size_t>(vocab) * 4);
}

MetalSampler::~MetalSampler() {
  for (DevBuffer* b : {x_, work_, seen_, counts_, bias_ids_, bias_vals_})
    if (b) dev_.release(b);
}

DevBuffer* MetalSampler::make(size_t bytes) { return dev_.alloc(std::max<size_t>(bytes, 4)); }

void MetalSampler::begin(const SampleOptions& o) {
  const bool greedy = is_greedy(o);
  // Bias entries merged per id (the kernel adds each span's entries from several threads: ids must be
  // distinct), ids outside the vocab dropped (as the CPU twin would fault on them, the engine never sends one).
  std::map<int32_t, float> bias;
  for (size_t i = 0; i < o.bias_ids.size() && i < o.bias_vals.size(); ++i)
    if (o.bias_ids[i] >= 0 && o.bias_ids[i] < V_) bias[o.bias_ids[i]] += o.bias_vals[i];
  if (bias.size() > bias_cap_) {
    for (DevBuffer** b : {&bias_ids_, &bias_vals_})
      if (*b) dev_.release(*b), *b = nullptr;
    bias_cap_ = std::max<size_t>(bias.size(), 2 * bias_cap_);
    bias_ids_ = make(bias_cap_ * 4);
    bias_vals_ = make(bias_cap_ * 4);
  }
  if (!bias_ids_) bias_ids_ = make(4), bias_vals_ = make(4), bias_cap_ = 1;
  auto* ids = static_cast<int32_t*>(dev_.contents(bias_ids_));
  auto* vals = static_cast<float*>(dev_.contents(bias_vals_));
  size_t n = 0;
  for (const auto& [id, v] : bias) ids[n] = id, vals[n++] = v;

  const size_t V = static_cast<size_t>(V_);
  auto* seen = static_cast<uint8_t*>(dev_.contents(seen_));
  auto* counts = static_cast<int32_t*>(dev_.contents(counts_));
  if (o.seen.size() == V) std::memcpy(seen, o.seen.data(), V);
  else std::memset(seen, 0, V);
  if (o.counts.size() == V) std::memcpy(counts, o.counts.data(), V * 4);
  else std::memset(counts, 0, V * 4);

  args_ = kp::SampleArgs{};
  args_.greedy = greedy ? 1 : 0;
  args_.inv_temperature = inverse_temperature(o);
  args_.top_k = o.top_k;
  args_.top_p = o.top_p;
  args_.min_p = o.min_p;
  args_.repetition_penalty = o.repetition_penalty;
  args_.presence_penalty = o.presence_penalty;
  args_.frequency_penalty = o.frequency_penalty;
  args_.n_bias = static_cast<int32_t>(n);
  args_.vocab = V_;
  // (top-k / top-p / min-p never drop the largest logit, so they do not change a greedy draw.)
  plain_greedy_ = greedy && o.repetition_penalty == 1.f && o.presence_penalty == 0.f && o.frequency_penalty == 0.f &&
                  n == 0;
}

void MetalSampler::draw(Ops& ops, Encoder& e, BufRef logits, BufRef uniform, BufRef tokens, int slot) {
  if (plain_greedy_) {
    ops.argmax(e, logits, V_, tokens, slot);
    return;
  }
  kp::SampleArgs a = args_;
  a.token_slot = slot;
  Ops::SampleBufs b;
  b.logits = logits;
  b.x = BufRef{x_, 0};
  b.work = BufRef{work_, 0};
  b.bias_ids = BufRef{bias_ids_, 0};
  b.bias_vals = BufRef{bias_vals_, 0};
  b.seen = BufRef{seen_, 0};
  b.counts = BufRef{counts_, 0};
  b.uniform = uniform;
  b.tokens = tokens;
  ops.sample(e, a, b);
}

}  // namespace lily::metal
