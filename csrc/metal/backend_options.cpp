// make_backend("metal", ..., options): reads the BackendOptions documented in backend_metal.h and picks the
// device. Apple builds (LILY_METAL_APPLE) run the Metal framework device; Linux builds (LILY_METAL_EMULATED)
// run the CPU emulator of Metal compute over kernel libraries that tools/msl/mslc.py builds from the
// embedded sources at first use (emu_runtime_compile) or that the caller built (emu_kernel_libs), so the
// real Engine, bindings and token loop run on the Metal backend in CI. Making the device compiles the
// kernels: a failure is MetalUnavailable (kernel_sources.h), which lily.model turns into
// BackendUnavailableError (backend="metal") or the CPU fallback with a warning (backend="auto").
#include <cstdlib>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>

#include "metal/backend_metal.h"
#include "metal/device.h"

namespace lily::metal {
namespace {

const std::set<std::string> kOptionNames = {
    "kv_bf16",        "cache_dir",         "inject_compile_error",   "use_metallib",  "pipeline_cache",
    "emu_kernel_libs", "emu_runtime_compile", "emu_toolchain",        "emu_python",    "emu_jobs",
    "emu_schedule",   "emu_threads",       "emu_max_threads",        "emu_tensor_ops", "emu_check_hazards",
    "emu_drop_barrier_before"};

std::string option(const BackendOptions& o, const std::string& name, const std::string& fallback = "") {
  auto it = o.find(name);
  return it == o.end() ? fallback : it->second;
}

std::string known_names() {
  std::string s;
  for (const std::string& n : kOptionNames) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// An integer option in [lo, hi]; `fallback` when absent.
long int_option(const BackendOptions& o, const std::string& name, long fallback, long lo, long hi) {
  auto it = o.find(name);
  if (it == o.end()) return fallback;
  const std::string& v = it->second;
  char* end = nullptr;
  const long x = v.empty() ? 0 : std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < lo || x > hi)
    throw std::invalid_argument("[lily] backend 'metal': option " + name + "='" + v + "' must be an integer in " +
                                std::to_string(lo) + ".." + std::to_string(hi));
  return x;
}

bool bool_option(const BackendOptions& o, const std::string& name, bool fallback) {
  return int_option(o, name, fallback ? 1 : 0, 0, 1) != 0;
}

}  // namespace

// The device the options select (shared by make_backend("metal") and lily_metal_probe). Compiling the
// kernels is part of making it, so a kernel that fails throws MetalUnavailable here.
std::unique_ptr<Device> make_device(const BackendOptions& options) {
  std::string unknown;
  for (const auto& [name, value] : options)
    if (!kOptionNames.count(name)) unknown += (unknown.empty() ? "'" : ", '") + name + "'";
  if (!unknown.empty())
    throw std::invalid_argument("[lily] backend 'metal' has no option " + unknown + " (options: " + known_names() +
                                ")");
  // The planted compile error (tests; a Mac user checking the fallback): the option, else the environment.
  std::string planted = option(options, "inject_compile_error");
  if (planted.empty() && std::getenv("LILY_METAL_INJECT_COMPILE_ERROR"))
    planted = std::getenv("LILY_METAL_INJECT_COMPILE_ERROR");
  const std::string cache = option(options, "cache_dir");
#if defined(LILY_METAL_EMULATED)
  EmuOptions eo;
  eo.kernel_libs = option(options, "emu_kernel_libs");
  const bool runtime_compile = bool_option(options, "emu_runtime_compile", false);
  if (!eo.kernel_libs.empty() && (runtime_compile || !planted.empty()))
    throw std::invalid_argument("[lily] backend 'metal': emu_kernel_libs gives prebuilt kernel libraries; "
                                "emu_runtime_compile and inject_compile_error need the runtime compile instead");
  if (eo.kernel_libs.empty()) {
    if (!runtime_compile)
      throw std::runtime_error(
          "[lily] backend 'metal' is built here over the emulated device only (for tests: no Apple GPU on this "
          "platform); pass options={'emu_runtime_compile': '1'} to compile the embedded kernel sources with "
          "tools/msl/mslc.py, or {'emu_kernel_libs': '<a.so>;<b.so>;...'} with prebuilt emulator builds of "
          "metal/*.metal, or use backend='cpu'");
    EmuCompileOptions co;
    co.cache_dir = cache;
    co.toolchain = option(options, "emu_toolchain");
    co.python = option(options, "emu_python");
    co.planted_error = planted;
    co.jobs = static_cast<int>(int_option(options, "emu_jobs", 2, 1, 64));
    EmuLibraries libs = compile_embedded_for_emulator(co);
    eo.kernel_libs = libs.kernel_libs;
    eo.library = libs.report;
  }
  eo.schedule = static_cast<int>(int_option(options, "emu_schedule", -1, -1, 2));
  eo.threads = static_cast<int>(int_option(options, "emu_threads", 2, 1, 1024));
  eo.max_threads = static_cast<uint32_t>(int_option(options, "emu_max_threads", 1024, 32, 1024));
  eo.tensor_ops = bool_option(options, "emu_tensor_ops", false);
  eo.check_hazards = bool_option(options, "emu_check_hazards", true);
  eo.drop_barrier_before = option(options, "emu_drop_barrier_before");
  return make_emulated_device(eo);
#else
  for (const auto& [name, value] : options)
    if (name.rfind("emu_", 0) == 0)
      throw std::invalid_argument("[lily] backend 'metal': the emu_* options select the emulated device, which is "
                                  "built into Linux installs only; this one runs the Apple device");
  AppleOptions ao;
  ao.cache_dir = cache;
  ao.planted_error = planted;
  ao.use_metallib = bool_option(options, "use_metallib", true);
  ao.pipeline_cache = bool_option(options, "pipeline_cache", true);
  return make_apple_device(ao);
#endif
}

std::unique_ptr<Backend> make_metal_backend(const Config& cfg, const Weights& w, const BackendOptions& options,
                                            bool debug) {
  const bool kv_bf16 = bool_option(options, "kv_bf16", true);
  return make_metal_backend(cfg, w, make_device(options), debug, kv_bf16);
}

}  // namespace lily::metal

// `lily info` (lily.model.metal_status, through ctypes: a C entry point of the extension, so the status needs
// no model). options: "name=value" lines, as make_backend("metal") takes them. Returns a malloc'd text of
// "key<TAB>value" lines (device, family, tensor_ops, library, source_hash, cache, cache_hit) or, when the
// device or its kernels are unavailable, one "error<TAB>" line followed by the message (several lines);
// free it with lily_metal_free.
extern "C" __attribute__((visibility("default"))) char* lily_metal_probe(const char* options_text) {
  using namespace lily::metal;
  std::string out;
  try {
    lily::BackendOptions options;
    std::string text = options_text ? options_text : "";
    for (size_t a = 0; a < text.size();) {
      size_t b = text.find('\n', a);
      if (b == std::string::npos) b = text.size();
      const std::string line = text.substr(a, b - a);
      const size_t eq = line.find('=');
      if (eq != std::string::npos) options[line.substr(0, eq)] = line.substr(eq + 1);
      a = b + 1;
    }
    std::unique_ptr<Device> dev = make_device(options);
    const LibraryReport r = dev->library();
    out = "device\t" + dev->name() + "\nfamily\t" + dev->family() + "\ntensor_ops\t" + r.tensor_ops +
          "\nlibrary\t" + r.origin + "\nsource_hash\t" + r.source_hash + "\ncache\t" + r.cache +
          "\ncache_hit\t" + (r.cache_hit ? "1" : "0") + "\n";
  } catch (const std::exception& e) {
    out = std::string("error\t") + e.what();
  }
  char* p = static_cast<char*>(std::malloc(out.size() + 1));
  if (p) std::memcpy(p, out.c_str(), out.size() + 1);
  return p;
}

extern "C" __attribute__((visibility("default"))) void lily_metal_free(char* p) { std::free(p); }
