// The Apple implementation of the device layer (metal/device.h) on the Metal framework, compiled with ARC.
// The kernels come from lily.metallib (metal/*.metal compiled by xcrun at build time) embedded in the
// extension as lily_metallib / lily_metallib_size; the Metal 4 tensor-op GEMMs (metal/gemm_tensor.metal,
// -std=metal4.0) from lily_tensor.metallib, loaded only on MTLGPUFamilyMetal4 devices (size 0 when the SDK
// had no Metal 4 compiler). On Linux this file is only type-checked (clang with the
// stub headers of tools/msl/hoststubs); it has not run on Apple hardware yet.
#import <Metal/Metal.h>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "metal/device.h"

extern "C" const unsigned char lily_metallib[];
extern "C" const unsigned long lily_metallib_size;
extern "C" const unsigned char lily_tensor_metallib[];
extern "C" const unsigned long lily_tensor_metallib_size;

namespace lily::metal {

struct DevBuffer {
  id<MTLBuffer> buf;
};

struct Pipeline {
  id<MTLComputePipelineState> pso;
  std::string name;
};

namespace {

std::string describe(NSError* err) {
  return err ? std::string(err.localizedDescription.UTF8String ? err.localizedDescription.UTF8String : "?")
             : std::string("unknown error");
}

// Buffers use shared storage (unified memory: contents() is the host view) and default, tracked hazard
// tracking, so Metal orders command buffers that touch the same buffer; within the concurrent encoder the
// backend's barrier() calls order dependent dispatches.
class MtlCommandBuffer final : public CommandBuffer, public Encoder {
 public:
  explicit MtlCommandBuffer(id<MTLCommandQueue> q) {
    cb_ = [q commandBuffer];
    if (!cb_) throw std::runtime_error("[lily] metal: could not create a command buffer");
    enc_ = [cb_ computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
    if (!enc_) throw std::runtime_error("[lily] metal: could not create a compute encoder");
  }
  Encoder& encoder() override { return *this; }
  void set_pipeline(Pipeline* p) override { [enc_ setComputePipelineState:p->pso]; }
  void set_buffer(int i, BufRef r) override { [enc_ setBuffer:r.buf->buf offset:r.offset atIndex:static_cast<NSUInteger>(i)]; }
  void set_bytes(int i, const void* d, size_t n) override {
    [enc_ setBytes:d length:n atIndex:static_cast<NSUInteger>(i)];
  }
  void dispatch(Size3 g, Size3 t) override {
    [enc_ dispatchThreadgroups:MTLSizeMake(g.x, g.y, g.z) threadsPerThreadgroup:MTLSizeMake(t.x, t.y, t.z)];
  }
  void barrier() override { [enc_ memoryBarrierWithScope:MTLBarrierScopeBuffers]; }
  void commit() override {
    [enc_ endEncoding];
    [cb_ commit];
    committed_ = true;
  }
  void wait() override {
    [cb_ waitUntilCompleted];
    if (cb_.status == MTLCommandBufferStatusError)
      throw std::runtime_error("[lily] metal: command buffer failed: " + describe(cb_.error));
  }
  bool committed() const override { return committed_; }

 private:
  id<MTLCommandBuffer> cb_;
  id<MTLComputeCommandEncoder> enc_;
  bool committed_ = false;
};

class MtlDevice final : public Device {
 public:
  MtlDevice() {
    dev_ = MTLCreateSystemDefaultDevice();
    if (!dev_) throw std::runtime_error("[lily] backend 'metal': no Metal device");
    queue_ = [dev_ newCommandQueue];
    dispatch_data_t data = dispatch_data_create(lily_metallib, lily_metallib_size, nil, DISPATCH_DATA_DESTRUCTOR_DEFAULT);
    NSError* err = nil;
    lib_ = [dev_ newLibraryWithData:data error:&err];
    if (!lib_) throw std::runtime_error("[lily] metal: loading lily.metallib failed: " + describe(err));
    load_tensor_library();
  }
  ~MtlDevice() override {
    for (auto& kv : pipes_) delete kv.second;
  }

  std::string name() const override { return dev_.name.UTF8String ? dev_.name.UTF8String : "metal"; }

  DevBuffer* alloc(size_t bytes) override {
    id<MTLBuffer> b = [dev_ newBufferWithLength:std::max<size_t>(bytes, 16) options:MTLResourceStorageModeShared];
    if (!b) throw std::runtime_error("[lily] metal: out of device memory (" + std::to_string(bytes) + " bytes)");
    return new DevBuffer{b};
  }

  // newBufferWithBytesNoCopy needs a page-aligned start and length: wrap the whole pages around p.
  BufRef wrap(const void* p, size_t bytes) override {
    const uintptr_t page = static_cast<uintptr_t>(getpagesize());
    const uintptr_t a = reinterpret_cast<uintptr_t>(p), base = a & ~(page - 1);
    const size_t len = (a + bytes - base + page - 1) & ~(page - 1);
    id<MTLBuffer> b = [dev_ newBufferWithBytesNoCopy:reinterpret_cast<void*>(base)
                                              length:len
                                             options:MTLResourceStorageModeShared
                                         deallocator:nil];
    if (!b) throw std::runtime_error("[lily] metal: could not wrap " + std::to_string(bytes) + " bytes of host memory");
    return BufRef{new DevBuffer{b}, static_cast<size_t>(a - base)};
  }

  void release(DevBuffer* b) override { delete b; }
  void* contents(DevBuffer* b) override { return [b->buf contents]; }

  Pipeline* pipeline(const std::string& name) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = pipes_.find(name);
    if (it != pipes_.end()) return it->second;
    NSString* fname = (NSString* _Nonnull)[NSString stringWithUTF8String:name.c_str()];
    id<MTLFunction> fn = [lib_ newFunctionWithName:fname];
    if (!fn && tensor_lib_) fn = [tensor_lib_ newFunctionWithName:fname];
    if (!fn) throw std::runtime_error("[lily] metal: lily.metallib has no kernel '" + name + "'");
    NSError* err = nil;
    id<MTLComputePipelineState> pso = [dev_ newComputePipelineStateWithFunction:fn error:&err];
    if (!pso) throw std::runtime_error("[lily] metal: pipeline '" + name + "': " + describe(err));
    auto* p = new Pipeline{pso, name};
    pipes_[name] = p;
    return p;
  }
  uint32_t max_threads(Pipeline* p) override { return static_cast<uint32_t>(p->pso.maxTotalThreadsPerThreadgroup); }
  std::unique_ptr<CommandBuffer> command_buffer() override { return std::make_unique<MtlCommandBuffer>(queue_); }

  // The tensor-op GEMMs run when the GPU is in MTLGPUFamilyMetal4 and their library loaded;
  // LILY_METAL_TENSOR_OPS=0 forces the simdgroup-matrix path (A/B comparisons on one machine).
  bool has_tensor_ops() const override { return tensor_lib_ != nil; }

 private:
  void load_tensor_library() {
    const char* env = std::getenv("LILY_METAL_TENSOR_OPS");
    if (lily_tensor_metallib_size == 0 || (env && std::strcmp(env, "0") == 0)) return;
    bool metal4 = false;
    if (@available(macOS 26.0, *)) metal4 = [dev_ supportsFamily:MTLGPUFamilyMetal4];
    if (!metal4) return;
    dispatch_data_t data =
        dispatch_data_create(lily_tensor_metallib, lily_tensor_metallib_size, nil, DISPATCH_DATA_DESTRUCTOR_DEFAULT);
    NSError* err = nil;
    tensor_lib_ = [dev_ newLibraryWithData:data error:&err];  // nil on failure: the simdgroup path runs
  }

  id<MTLDevice> dev_;
  id<MTLCommandQueue> queue_;
  id<MTLLibrary> lib_;
  id<MTLLibrary> tensor_lib_ = nil;  // Metal 4 tensor-op kernels, nil where unavailable
  std::map<std::string, Pipeline*> pipes_;
  std::mutex mu_;
};

}  // namespace

std::unique_ptr<Device> make_apple_device() { return std::make_unique<MtlDevice>(); }

}  // namespace lily::metal
