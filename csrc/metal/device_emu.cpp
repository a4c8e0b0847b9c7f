// The emulated Metal device (Linux): kernels are the metal/*.metal files built by tools/msl/mslc.py into
// shared libraries (one launcher per [[host_name]]) and run by the fiber emulator (libmsl_rt.so).
// Command buffers execute on one queue thread in commit order, asynchronously to the host, as on a GPU.
// Owned buffers sit right before a PROT_NONE guard page, so a kernel reading or writing past the end of a
// scratch buffer faults. The encoder checks barrier placement: a dispatch that reads a buffer written
// since the last barrier, or writes one read or written since then, is reported as a missing barrier.
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "metal/device.h"

namespace lily::metal {

struct DevBuffer {
  void* p = nullptr;
  size_t bytes = 0;
  void* map = nullptr;  // owned mapping (guard page after the data), null for wrapped host memory
  size_t map_len = 0;
};

struct Pipeline {
  std::string name;
  void (*launch)(void**, void**) = nullptr;
  std::string access;  // per buffer index: 'r' read-only, 'w' written, '-' unused
};

namespace {

using DispatchFn = int (*)(void (*)(void**, void**), const unsigned*, const unsigned*, void**, const unsigned long*,
                           int, int, unsigned, int, char*, int, double*);

struct Cmd {
  Pipeline* p = nullptr;
  Size3 grid, tg;
  std::vector<void*> bufs;
};

class EmuDevice;

class EmuCommandBuffer final : public CommandBuffer, public Encoder {
 public:
  explicit EmuCommandBuffer(EmuDevice* dev) : dev_(dev) {}
  ~EmuCommandBuffer() override;

  Encoder& encoder() override { return *this; }
  void commit() override;
  void wait() override;
  bool committed() const override { return committed_; }

  void set_pipeline(Pipeline* p) override { pipe_ = p; }
  void set_buffer(int i, BufRef r) override {
    grow(i);
    bound_[i] = r;
    ptrs_[i] = static_cast<char*>(r.buf->p) + r.offset;
  }
  void set_bytes(int i, const void* d, size_t n) override {
    grow(i);
    bytes_.emplace_back(static_cast<const char*>(d), static_cast<const char*>(d) + n);
    bound_[i] = BufRef{};
    ptrs_[i] = bytes_.back().data();
  }
  void dispatch(Size3 grid, Size3 tg) override;
  // Applied at the next dispatch, so a planted bug can drop the one before a given kernel.
  void barrier() override { barrier_pending_ = true; }

  // queue side
  void run();
  void finish(const std::string& err) {
    std::lock_guard<std::mutex> g(mu_);
    error_ = err;
    done_ = true;
    cv_.notify_all();
  }

 private:
  void grow(int i) {
    if (static_cast<int>(ptrs_.size()) <= i) ptrs_.resize(i + 1, nullptr), bound_.resize(i + 1);
  }
  EmuDevice* dev_;
  Pipeline* pipe_ = nullptr;
  std::vector<void*> ptrs_;
  std::vector<BufRef> bound_;
  std::deque<std::vector<char>> bytes_;  // set_bytes copies, alive until the command buffer is destroyed
  std::vector<Cmd> cmds_;
  std::map<DevBuffer*, std::string> written_, read_;  // since the last barrier -> kernel name
  std::string hazards_;
  bool committed_ = false, done_ = false, barrier_pending_ = false;
  std::string error_;
  std::mutex mu_;
  std::condition_variable cv_;
};

class EmuDevice final : public Device {
 public:
  explicit EmuDevice(const EmuOptions& o) : opt_(o) {
    size_t a = 0;
    while (a <= o.kernel_libs.size()) {
      size_t b = o.kernel_libs.find(';', a);
      if (b == std::string::npos) b = o.kernel_libs.size();
      if (b > a) {
        const std::string path = o.kernel_libs.substr(a, b - a);
        void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
        if (!h) throw std::runtime_error(std::string("[lily] metal emulator: cannot load ") + path + ": " + dlerror());
        libs_.push_back(h);
        if (!dispatch_) dispatch_ = reinterpret_cast<DispatchFn>(dlsym(h, "msl_dispatch"));
      }
      a = b + 1;
    }
    if (!dispatch_) throw std::runtime_error("[lily] metal emulator: no kernel library given (EmuOptions.kernel_libs)");
    queue_ = std::thread([this] { loop(); });
  }
  ~EmuDevice() override {
    {
      std::lock_guard<std::mutex> g(qmu_);
      stop_ = true;
      qcv_.notify_all();
    }
    queue_.join();
    for (auto& kv : pipes_) delete kv.second;
    for (auto& kv : prof_)
      std::fprintf(stderr, "emu %-28s %6ld dispatches %8.3f s\n", kv.first.c_str(), kv.second.second, kv.second.first);
  }

  std::string name() const override { return "emulated"; }

  DevBuffer* alloc(size_t bytes) override {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t n = (std::max<size_t>(bytes, 1) + 15) / 16 * 16;
    const size_t body = (n + page - 1) / page * page;
    void* m = mmap(nullptr, body + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    mprotect(static_cast<char*>(m) + body, page, PROT_NONE);
    auto* b = new DevBuffer{static_cast<char*>(m) + body - n, bytes, m, body + page};
    return b;
  }
  BufRef wrap(const void* p, size_t bytes) override {
    return BufRef{new DevBuffer{const_cast<void*>(p), bytes, nullptr, 0}, 0};
  }
  void release(DevBuffer* b) override {
    if (b && b->map) munmap(b->map, b->map_len);
    delete b;
  }
  void* contents(DevBuffer* b) override { return b->p; }

  Pipeline* pipeline(const std::string& name) override {
    std::lock_guard<std::mutex> g(pmu_);
    auto it = pipes_.find(name);
    if (it != pipes_.end()) return it->second;
    for (void* h : libs_) {
      auto fn = reinterpret_cast<void (*)(void**, void**)>(dlsym(h, ("__msl_launch_" + name).c_str()));
      if (!fn) continue;
      auto* acc = static_cast<const char*>(dlsym(h, ("__msl_access_" + name).c_str()));
      auto* p = new Pipeline{name, fn, acc ? acc : ""};
      pipes_[name] = p;
      return p;
    }
    throw std::runtime_error("[lily] metal emulator: no kernel named '" + name + "' in the kernel libraries");
  }
  uint32_t max_threads(Pipeline*) override { return opt_.max_threads; }
  std::unique_ptr<CommandBuffer> command_buffer() override { return std::make_unique<EmuCommandBuffer>(this); }
  bool has_tensor_ops() const override { return opt_.tensor_ops; }
  std::string family() const override { return "CPU emulator of Metal compute, tools/msl"; }
  LibraryReport library() const override {
    LibraryReport r = opt_.library;
    if (r.origin.empty()) r.origin = "emulator kernel libraries given by the caller (emu_kernel_libs)";
    r.tensor_ops = opt_.tensor_ops ? "on (emu_tensor_ops=1)" : "off (emu_tensor_ops=0)";
    return r;
  }

  void submit(EmuCommandBuffer* cb) {
    std::lock_guard<std::mutex> g(qmu_);
    q_.push_back(cb);
    qcv_.notify_all();
  }
  // Waits until cb has left the queue (the command buffer must not be destroyed before).
  void drain(EmuCommandBuffer* cb) {
    std::unique_lock<std::mutex> g(qmu_);
    qcv_.wait(g, [&] { return current_ != cb && std::find(q_.begin(), q_.end(), cb) == q_.end(); });
  }

  const EmuOptions& opt() const { return opt_; }
  // LILY_EMU_PROFILE=1 (debugging aid): emulator seconds per kernel, printed when the device is destroyed.
  void account(const std::string& k, double secs) {
    if (!profile_) return;
    std::lock_guard<std::mutex> g(pmu_);
    auto& e = prof_[k];
    e.first += secs;
    e.second += 1;
  }
  DispatchFn dispatch_fn() const { return dispatch_; }
  unsigned next_seq() { return seq_++; }

 private:
  void loop() {
    for (;;) {
      EmuCommandBuffer* cb;
      {
        std::unique_lock<std::mutex> g(qmu_);
        qcv_.wait(g, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;
        cb = current_ = q_.front();
        q_.pop_front();
      }
      cb->run();
      std::lock_guard<std::mutex> g(qmu_);
      current_ = nullptr;
      qcv_.notify_all();
    }
  }

  EmuOptions opt_;
  std::vector<void*> libs_;
  DispatchFn dispatch_ = nullptr;
  std::map<std::string, Pipeline*> pipes_;
  std::mutex pmu_, qmu_;
  std::condition_variable qcv_;
  std::deque<EmuCommandBuffer*> q_;
  EmuCommandBuffer* current_ = nullptr;
  bool stop_ = false;
  std::thread queue_;
  unsigned seq_ = 0;
  bool profile_ = std::getenv("LILY_EMU_PROFILE") != nullptr;
  std::map<std::string, std::pair<double, long>> prof_;
};

EmuCommandBuffer::~EmuCommandBuffer() {
  if (committed_) dev_->drain(this);
}

void EmuCommandBuffer::dispatch(Size3 grid, Size3 tg) {
  if (!pipe_) throw std::logic_error("[lily] metal: dispatch without a pipeline");
  if (tg.x * tg.y * tg.z > dev_->opt().max_threads)
    hazards_ += "kernel " + pipe_->name + ": " + std::to_string(tg.x * tg.y * tg.z) +
                " threads per threadgroup exceed the pipeline's maximum " + std::to_string(dev_->opt().max_threads) + "\n";
  if (committed_) throw std::logic_error("[lily] metal: dispatch into a committed command buffer");
  const std::string& drop = dev_->opt().drop_barrier_before;  // a planted bug (EmuOptions)
  if (barrier_pending_ && (drop.empty() || pipe_->name.rfind(drop, 0) != 0)) {
    written_.clear();
    read_.clear();
  }
  barrier_pending_ = false;
  const std::string& acc = pipe_->access;
  for (size_t i = 0; i < acc.size(); ++i) {
    if (acc[i] == '-') continue;
    if (i >= ptrs_.size() || !ptrs_[i]) {
      hazards_ += "kernel " + pipe_->name + ": buffer(" + std::to_string(i) + ") not bound\n";
      continue;
    }
    DevBuffer* b = bound_[i].buf;
    if (!b || !dev_->opt().check_hazards) continue;
    auto w = written_.find(b);
    if (w != written_.end())
      hazards_ += "missing barrier: " + pipe_->name + " uses buffer(" + std::to_string(i) + ") written by " +
                  w->second + " without a barrier in between\n";
    auto r = read_.find(b);
    if (acc[i] == 'w' && r != read_.end())
      hazards_ += "missing barrier: " + pipe_->name + " writes buffer(" + std::to_string(i) + ") read by " +
                  r->second + " without a barrier in between\n";
  }
  for (size_t i = 0; i < acc.size() && i < bound_.size(); ++i)
    if (bound_[i].buf && acc[i] != '-') (acc[i] == 'w' ? written_ : read_)[bound_[i].buf] = pipe_->name;
  cmds_.push_back(Cmd{pipe_, grid, tg, ptrs_});
}

void EmuCommandBuffer::commit() {
  if (committed_) throw std::logic_error("[lily] metal: command buffer committed twice");
  committed_ = true;
  dev_->submit(this);
}

void EmuCommandBuffer::run() {
  std::string err = hazards_;
  for (Cmd& c : cmds_) {
    if (!err.empty()) break;
    const unsigned grid[3] = {c.grid.x, c.grid.y, c.grid.z}, tg[3] = {c.tg.x, c.tg.y, c.tg.z};
    const int sched = dev_->opt().schedule >= 0 ? dev_->opt().schedule : static_cast<int>(dev_->next_seq() % 3);
    std::vector<char> msg(1 << 14);
    double stats[8];
    const int n = dev_->dispatch_fn()(c.p->launch, grid, tg, c.bufs.data(), nullptr, 0, sched, 1u, dev_->opt().threads,
                                      msg.data(), static_cast<int>(msg.size()), stats);
    if (n) err += "kernel " + c.p->name + " (schedule " + std::to_string(sched) + "): " + msg.data();
    dev_->account(c.p->name, stats[0]);
  }
  finish(err);
}

void EmuCommandBuffer::wait() {
  if (!committed_) throw std::logic_error("[lily] metal: wait on a command buffer that was not committed");
  std::unique_lock<std::mutex> g(mu_);
  cv_.wait(g, [&] { return done_; });
  if (!error_.empty()) throw std::runtime_error("[lily] metal (emulated device): " + error_);
}

}  // namespace

std::unique_ptr<Device> make_emulated_device(const EmuOptions& opt) { return std::make_unique<EmuDevice>(opt); }

}  // namespace lily::metal
