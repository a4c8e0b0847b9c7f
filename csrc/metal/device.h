// The narrow device layer under the Metal backend. Two implementations: device_mtl.mm (Apple: the Metal
// framework, a metallib compiled from metal/*.metal) and device_emu.cpp (Linux: the same kernels built by
// tools/msl and run in the CPU emulator). Everything above it (backend_metal.cpp, ops_metal.cpp: which
// kernels, buffers, threadgroup sizes, the decode loop) is the same code on both.
//
// Model: buffers live in memory shared with the CPU (Apple unified memory; contents() is host-visible).
// A command buffer has one compute encoder with concurrent dispatch: dispatches may overlap unless a
// barrier() separates them, so the caller places a barrier wherever data flows. Command buffers of one
// device execute in commit order.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "metal/kernel_sources.h"

namespace lily::metal {

struct DevBuffer;   // opaque, owned by the Device
struct Pipeline;    // opaque, cached by the Device per specialisation name

struct BufRef {
  DevBuffer* buf = nullptr;
  size_t offset = 0;  // bytes
};

struct Size3 {
  uint32_t x = 1, y = 1, z = 1;
};

class Encoder {
 public:
  virtual ~Encoder() = default;
  virtual void set_pipeline(Pipeline* p) = 0;
  virtual void set_buffer(int index, BufRef r) = 0;
  // Small argument structs (params.h) copied at encode time.
  virtual void set_bytes(int index, const void* data, size_t bytes) = 0;
  // grid: threadgroups per grid; tg: threads per threadgroup.
  virtual void dispatch(Size3 grid, Size3 tg) = 0;
  // Every dispatch before completes, and its memory writes are visible, before any dispatch after starts.
  virtual void barrier() = 0;
};

class CommandBuffer {
 public:
  virtual ~CommandBuffer() = default;
  virtual Encoder& encoder() = 0;
  // Ends encoding and submits; execution is asynchronous.
  virtual void commit() = 0;
  // Blocks until the command buffer has completed; throws std::runtime_error if the device reported an
  // error (in emulation: any kernel diagnostic, a missing barrier, a crash).
  virtual void wait() = 0;
  virtual bool committed() const = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;
  // Zero-filled buffer in shared storage.
  virtual DevBuffer* alloc(size_t bytes) = 0;
  // A buffer over existing host memory (memory-mapped weights) without a copy; the memory must outlive
  // it. Returns the buffer and the offset of p inside it (Apple rounds to whole pages).
  virtual BufRef wrap(const void* p, size_t bytes) = 0;
  virtual void release(DevBuffer* b) = 0;
  virtual void* contents(DevBuffer* b) = 0;
  // The compute pipeline of a kernel by its [[host_name]], created on first use and cached.
  virtual Pipeline* pipeline(const std::string& name) = 0;
  // Upper bound of threads per threadgroup for a pipeline (1024 on Apple GPUs, less for heavy kernels).
  virtual uint32_t max_threads(Pipeline* p) = 0;
  virtual std::unique_ptr<CommandBuffer> command_buffer() = 0;
  // Metal 4 tensor operations (MetalPerformancePrimitives) are available and their kernels
  // (metal/gemm_tensor.metal) loaded: gates the tensor-op GEMM path of the prefill matrices.
  virtual bool has_tensor_ops() const = 0;
  // For `lily info` and the tests: the GPU family ("Apple9, Metal3", "emulated"), and how the kernels
  // were obtained (compiled from the embedded sources at run time, a build-time metallib, cache hit).
  virtual std::string family() const = 0;
  virtual LibraryReport library() const = 0;
};

// Options of the emulated device (Linux). kernel_libs: ';'-separated paths of kernel libraries built by
// tools/msl/mslc.py (one per metal/*.metal file). schedule: 0, 1, 2 (see tools/msl/rt/msl_rt.cpp) or
// -1 to rotate through the three per dispatch. check_hazards: report a dispatch that touches a buffer
// written (or writes one read) by an earlier dispatch of the same encoder without a barrier in between.
struct EmuOptions {
  std::string kernel_libs;
  int schedule = -1;
  int threads = 2;
  bool check_hazards = true;
  // Per-pipeline thread limit to emulate (Apple lowers it for register-heavy kernels), so the backend's
  // fallbacks for a pipeline that cannot run 1024 threads are exercised in CI too.
  uint32_t max_threads = 1024;
  // Report Metal 4 tensor ops, so the backend runs the tensor-op GEMMs (emulated by the shim's matmul2d);
  // off: the simdgroup-matrix path, as on a machine without them.
  bool tensor_ops = false;
  // A planted bug for tests/metal/test_planted_bugs.py: the barrier right before each dispatch of a kernel
  // whose name starts with this is ignored, as if the backend had not placed it (the check must report it).
  std::string drop_barrier_before;
  // How kernel_libs were obtained (compile_embedded_for_emulator, or given by the caller).
  LibraryReport library;
};
std::unique_ptr<Device> make_emulated_device(const EmuOptions& opt);

// The emulated device's runtime compile (library_emu.cpp): the embedded kernel texts built by
// tools/msl/mslc.py into kernel libraries under cache_dir (kernel_sources.h: cache_dir()), validated.
// Throws MetalUnavailable naming each kernel file that failed, with the compiler's diagnostics.
struct EmuCompileOptions {
  std::string cache_dir;      // "" = the default cache folder
  std::string toolchain;      // path of tools/msl/mslc.py ("" = $LILY_MSLC, else this source tree's)
  std::string python;         // interpreter ("" = $LILY_PYTHON, else this process if Python, else python3)
  std::string planted_error;  // kernel_sources(planted_error)
  int jobs = 2;               // compilers in parallel
};
struct EmuLibraries {
  std::string kernel_libs;  // for EmuOptions::kernel_libs
  LibraryReport report;
};
EmuLibraries compile_embedded_for_emulator(const EmuCompileOptions& opt);

// Apple: the default Metal device; kernels from a build-time lily.metallib when the extension carries one,
// else compiled at first use from the embedded sources (newLibraryWithSource), pipelines cached in an
// MTLBinaryArchive under cache_dir keyed by source hash, OS version and GPU (device_mtl.mm).
struct AppleOptions {
  std::string cache_dir;      // "" = the default cache folder
  std::string planted_error;  // kernel_sources(planted_error); forces the runtime compile
  bool use_metallib = true;   // false: ignore a build-time metallib, compile the embedded sources
  bool pipeline_cache = true; // false: no binary archive
};
std::unique_ptr<Device> make_apple_device(const AppleOptions& opt);

}  // namespace lily::metal
