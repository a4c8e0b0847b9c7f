// Where a State's arrays live: host memory for the CPU backend, device memory for GPU backends.
// The core allocates and copies through this interface only, so it never includes a GPU header.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

namespace lily {

class Memory {
 public:
  virtual ~Memory() = default;
  // Zero-filled allocation of `bytes` (never null for bytes > 0; throws std::runtime_error on failure).
  virtual void* alloc(size_t bytes) = 0;
  virtual void release(void* p) noexcept = 0;
  // Copies inside this memory, and across to/from host memory; all complete before they return.
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void to_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void from_host(void* dst, const void* src, size_t bytes) = 0;
};

// Plain host memory (CPU backend).
std::shared_ptr<Memory> host_memory();

// An owned allocation in some Memory; move-only.
class Buffer {
 public:
  Buffer() = default;
  Buffer(std::shared_ptr<Memory> mem, size_t bytes) : mem_(std::move(mem)), bytes_(bytes) {
    if (bytes_) p_ = mem_->alloc(bytes_);
  }
  Buffer(Buffer&& o) noexcept : mem_(std::move(o.mem_)), p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr, o.bytes_ = 0; }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      mem_ = std::move(o.mem_), p_ = o.p_, bytes_ = o.bytes_;
      o.p_ = nullptr, o.bytes_ = 0;
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  void reset() noexcept {
    if (p_) mem_->release(p_);
    p_ = nullptr, bytes_ = 0;
  }
  void* data() const { return p_; }
  template <class T> T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }
  Memory* memory() const { return mem_.get(); }

 private:
  std::shared_ptr<Memory> mem_;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace lily
