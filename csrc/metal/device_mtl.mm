// The Apple implementation of the device layer (metal/device.h) on the Metal framework, compiled with ARC.
// Kernels (issue 16): from lily.metallib when the build had Xcode's Metal toolchain (metal.cmake embeds it
// as lily_metallib / _size, size 0 otherwise), else compiled at first use from the sources embedded as text
// (kernel_sources.h) with newLibraryWithSource, one library per kernel file, each validated (every kernel
// the file declares must be in it). A failure throws MetalUnavailable naming the file and the compiler's
// diagnostics, so backend="auto" falls back to the CPU and backend="metal" raises BackendUnavailableError.
// Compiled pipelines are cached in an MTLBinaryArchive under the cache folder, keyed by the source hash, the
// OS version and the GPU. The Metal 4 tensor-op GEMMs (metal/gemm_tensor.metal) load only on
// MTLGPUFamilyMetal4 devices (lily_tensor.metallib, or the embedded source compiled as Metal 4.0); when
// they fail the simdgroup GEMMs run and `lily info` says why. On Linux this file is only type-checked (clang
// with the stub headers of tools/msl/hoststubs); it has not run on Apple hardware yet.
#import <Metal/Metal.h>

#include <unistd.h>

#include <sys/stat.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "metal/device.h"
#include "metal/kernel_sources.h"

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

std::string ns(NSString* _Nullable s) { return s && s.UTF8String ? std::string(s.UTF8String) : std::string(); }

bool file_exists(const std::string& p) {
  struct stat st;
  return stat(p.c_str(), &st) == 0;
}

// Letters, digits, '.', '-' only: the OS version and GPU name become part of a file name.
std::string file_key(const std::string& s) {
  std::string k;
  for (char c : s) k += (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-') ? c : '_';
  return k;
}

// Math as metal.cmake's -fno-fast-math: IEEE-safe optimisations and precise fp32 functions.
MTLCompileOptions* compile_options(MTLLanguageVersion version) {
  MTLCompileOptions* co = [MTLCompileOptions new];
  co.languageVersion = version;
  if (@available(macOS 15.0, *)) {
    co.mathMode = MTLMathModeSafe;
    co.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
  } else {
    co.fastMathEnabled = NO;
  }
  return co;
}

class MtlDevice final : public Device {
 public:
  explicit MtlDevice(const AppleOptions& o) {
    dev_ = MTLCreateSystemDefaultDevice();
    if (!dev_)
      throw MetalUnavailable("no Metal device (MTLCreateSystemDefaultDevice returned nil: a virtual machine or a "
                             "Mac without a Metal GPU?)");
    queue_ = [dev_ newCommandQueue];
    if (!queue_) throw MetalUnavailable("the Metal device '" + name() + "' gave no command queue");
    sources_ = kernel_sources(o.planted_error);
    report_.source_hash = sources_hash(sources_);
    // a build-time metallib is compiled from the files on disk at configure time, so it is skipped when a
    // planted error asks for the runtime compile (tests, and a Mac user checking the fallback)
    if (o.use_metallib && o.planted_error.empty() && lily_metallib_size > 0) load_metallib();
    if (libs_.empty()) compile_sources();
    load_tensor_library(o.use_metallib && o.planted_error.empty());
    if (o.pipeline_cache) open_archive(cache_dir(o.cache_dir));
  }
  ~MtlDevice() override {
    save_archive();
    for (auto& kv : pipes_) delete kv.second;
  }

  std::string name() const override { return dev_.name.UTF8String ? dev_.name.UTF8String : "metal"; }

  std::string family() const override {
    std::string f;
    if (@available(macOS 26.0, *)) {
      if ([dev_ supportsFamily:MTLGPUFamilyApple10]) f = "Apple10";
    }
    const MTLGPUFamily apple[] = {MTLGPUFamilyApple9, MTLGPUFamilyApple8, MTLGPUFamilyApple7};
    const char* names[] = {"Apple9", "Apple8", "Apple7"};
    for (int i = 0; i < 3 && f.empty(); ++i)
      if ([dev_ supportsFamily:apple[i]]) f = names[i];
    if (f.empty()) f = "older than Apple7";
    bool metal4 = false;
    if (@available(macOS 26.0, *)) metal4 = [dev_ supportsFamily:MTLGPUFamilyMetal4];
    return f + (metal4 ? ", Metal4" : [dev_ supportsFamily:MTLGPUFamilyMetal3] ? ", Metal3" : "");
  }

  LibraryReport library() const override {
    LibraryReport r = report_;
    r.tensor_ops = tensor_lib_ ? "on" : tensor_note_;
    return r;
  }

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

  // The pipeline of a kernel: from the binary archive when it holds it (no GPU compile), else compiled and
  // added to the archive, which the destructor writes back.
  Pipeline* pipeline(const std::string& name) override {
    std::lock_guard<std::mutex> g(mu_);
    auto it = pipes_.find(name);
    if (it != pipes_.end()) return it->second;
    NSString* fname = (NSString* _Nonnull)[NSString stringWithUTF8String:name.c_str()];
    id<MTLFunction> fn = nil;
    for (id<MTLLibrary> lib : libs_)
      if (!fn) fn = [lib newFunctionWithName:fname];
    if (!fn && tensor_lib_) fn = [tensor_lib_ newFunctionWithName:fname];
    if (!fn) throw std::runtime_error("[lily] metal: no kernel '" + name + "' in the compiled libraries");
    MTLComputePipelineDescriptor* desc = [MTLComputePipelineDescriptor new];
    desc.computeFunction = fn;
    NSError* err = nil;
    id<MTLComputePipelineState> pso = nil;
    if (archive_) {
      desc.binaryArchives = @[ archive_ ];
      pso = [dev_ newComputePipelineStateWithDescriptor:desc
                                                options:MTLPipelineOptionFailOnBinaryArchiveMiss
                                             reflection:nil
                                                  error:&err];
    }
    if (!pso) {
      err = nil;
      pso = [dev_ newComputePipelineStateWithDescriptor:desc options:MTLPipelineOptionNone reflection:nil error:&err];
      if (!pso) throw std::runtime_error("[lily] metal: pipeline '" + name + "': " + describe(err));
      NSError* add_err = nil;
      if (archive_ && [archive_ addComputePipelineFunctionsWithDescriptor:desc error:&add_err]) archive_dirty_ = true;
    }
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
  void load_metallib() {
    dispatch_data_t data = dispatch_data_create(lily_metallib, lily_metallib_size, nil, DISPATCH_DATA_DESTRUCTOR_DEFAULT);
    NSError* err = nil;
    id<MTLLibrary> lib = [dev_ newLibraryWithData:data error:&err];
    if (!lib) {  // e.g. built by a newer SDK than this OS loads: the runtime compile takes over
      report_.origin = "build-time lily.metallib did not load (" + describe(err) + "); ";
      return;
    }
    libs_.push_back(lib);
    report_.origin = "build-time lily.metallib (Xcode's Metal toolchain was present at build time)";
  }

  // Every embedded kernel file but the tensor-op one, as MSL 3.0 (metal.cmake's -std=metal3.0).
  void compile_sources() {
    std::vector<CompileFailure> failures;
    MTLCompileOptions* co = compile_options(MTLLanguageVersion3_0);
    for (const KernelSource& k : sources_) {
      if (k.file == "gemm_tensor.metal") continue;
      id<MTLLibrary> lib = compile(k, co, failures);
      if (lib) libs_.push_back(lib);
    }
    if (!failures.empty()) throw_compile_failures(failures, "MTLDevice newLibraryWithSource");
    report_.origin += "embedded sources, compiled at run time (newLibraryWithSource)";
  }

  // One kernel file; nil with a CompileFailure (the compiler's diagnostics, or the kernels it lacks).
  id<MTLLibrary> _Nullable compile(const KernelSource& k, MTLCompileOptions* co, std::vector<CompileFailure>& failures) {
    NSString* text = [NSString stringWithUTF8String:k.text.c_str()];
    if (!text) {
      failures.push_back({k.file, "the embedded text is not valid UTF-8"});
      return nil;
    }
    NSError* err = nil;
    id<MTLLibrary> lib = [dev_ newLibraryWithSource:(NSString* _Nonnull)text options:co error:&err];
    if (!lib) {
      failures.push_back({k.file, describe(err)});
      return nil;
    }
    std::string missing;
    NSArray<NSString*>* names = lib.functionNames;
    for (const std::string& kn : k.kernels)
      if (![names containsObject:(NSString* _Nonnull)[NSString stringWithUTF8String:kn.c_str()]]) missing += " " + kn;
    if (!missing.empty()) {
      failures.push_back({k.file, "validation: kernels missing from the compiled library:" + missing});
      return nil;
    }
    return lib;
  }

  void load_tensor_library(bool metallib_allowed) {
    const char* env = std::getenv("LILY_METAL_TENSOR_OPS");
    if (env && std::strcmp(env, "0") == 0) {
      tensor_note_ = "off (LILY_METAL_TENSOR_OPS=0)";
      return;
    }
    bool metal4 = false;
    if (@available(macOS 26.0, *)) metal4 = [dev_ supportsFamily:MTLGPUFamilyMetal4];
    if (!metal4) {
      tensor_note_ = "off (the GPU is not in MTLGPUFamilyMetal4, or macOS is older than 26)";
      return;
    }
    if (metallib_allowed && lily_tensor_metallib_size > 0) {
      dispatch_data_t data =
          dispatch_data_create(lily_tensor_metallib, lily_tensor_metallib_size, nil, DISPATCH_DATA_DESTRUCTOR_DEFAULT);
      NSError* err = nil;
      tensor_lib_ = [dev_ newLibraryWithData:data error:&err];
      if (tensor_lib_) return;
    }
    const KernelSource* k = find_source(sources_, "gemm_tensor.metal");
    if (!k) {
      tensor_note_ = "off (gemm_tensor.metal is not embedded)";
      return;
    }
    if (@available(macOS 26.0, *)) {
      std::vector<CompileFailure> failures;
      tensor_lib_ = compile(*k, compile_options(MTLLanguageVersion4_0), failures);
      // not fatal: the simdgroup-matrix GEMMs cover every shape
      if (!tensor_lib_) tensor_note_ = "off (gemm_tensor.metal did not compile as Metal 4.0: " + failures[0].diagnostics + ")";
    }
  }

  // <cache>/pipelines-<source hash>-<OS version>-<GPU>.binarchive: a pipeline compiled on one run is a lookup
  // on the next; a new OS (new GPU compiler) or changed sources start a new archive.
  void open_archive(const std::string& dir) {
    const std::string os = ns([[NSProcessInfo processInfo] operatingSystemVersionString]);
    archive_path_ = dir + "/pipelines-" + report_.source_hash + (libs_from_metallib() ? "-metallib" : "") + "-" +
                    file_key(os) + "-" + file_key(name()) + ".binarchive";
    report_.cache = archive_path_;
    MTLBinaryArchiveDescriptor* desc = [MTLBinaryArchiveDescriptor new];
    const bool have = file_exists(archive_path_);
    if (have) desc.url = [NSURL fileURLWithPath:(NSString* _Nonnull)[NSString stringWithUTF8String:archive_path_.c_str()]];
    NSError* err = nil;
    archive_ = [dev_ newBinaryArchiveWithDescriptor:desc error:&err];
    if (!archive_ && have) {  // unreadable (an interrupted write): start an empty one
      desc.url = nil;
      archive_ = [dev_ newBinaryArchiveWithDescriptor:desc error:&err];
    }
    report_.cache_hit = have && archive_ != nil;
  }

  // Written to a temporary file and renamed, so a concurrent reader never sees half an archive.
  void save_archive() {
    if (!archive_ || !archive_dirty_) return;
    const std::string tmp = archive_path_ + "." + std::to_string(getpid()) + ".tmp";
    NSURL* url = [NSURL fileURLWithPath:(NSString* _Nonnull)[NSString stringWithUTF8String:tmp.c_str()]];
    NSError* err = nil;
    if ([archive_ serializeToURL:url error:&err])
      std::rename(tmp.c_str(), archive_path_.c_str());
    else
      std::remove(tmp.c_str());  // a cache: losing it costs compile time only
  }

  bool libs_from_metallib() const { return report_.origin.rfind("build-time", 0) == 0; }

  id<MTLDevice> dev_;
  id<MTLCommandQueue> queue_;
  std::vector<id<MTLLibrary>> libs_;  // one per kernel file (runtime compile) or lily.metallib
  id<MTLLibrary> tensor_lib_ = nil;   // Metal 4 tensor-op kernels, nil where unavailable
  std::string tensor_note_;
  id<MTLBinaryArchive> archive_ = nil;
  bool archive_dirty_ = false;
  std::string archive_path_;
  std::vector<KernelSource> sources_;
  LibraryReport report_;
  std::map<std::string, Pipeline*> pipes_;
  std::mutex mu_;
};

}  // namespace

std::unique_ptr<Device> make_apple_device(const AppleOptions& opt) { return std::make_unique<MtlDevice>(opt); }

}  // namespace lily::metal
