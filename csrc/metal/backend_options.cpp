// make_backend("metal", ..., options): reads the BackendOptions documented in backend_metal.h and picks the
// device. Apple builds (LILY_METAL_APPLE) run the Metal framework device; Linux builds (LILY_METAL_EMULATED)
// run the CPU emulator of Metal compute over kernel libraries that tools/msl/mslc.py builds at test time, so
// the real Engine, bindings and token loop run on the Metal backend in CI.
#include <cstdlib>
#include <set>
#include <stdexcept>
#include <string>

#include "metal/backend_metal.h"
#include "metal/device.h"

namespace lily::metal {
namespace {

const std::set<std::string> kOptionNames = {"kv_bf16",         "emu_kernel_libs", "emu_schedule",
                                            "emu_threads",     "emu_max_threads", "emu_tensor_ops",
                                            "emu_check_hazards", "emu_drop_barrier_before"};

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

std::unique_ptr<Backend> make_metal_backend(const Config& cfg, const Weights& w, const BackendOptions& options,
                                            bool debug) {
  std::string unknown;
  for (const auto& [name, value] : options)
    if (!kOptionNames.count(name)) unknown += (unknown.empty() ? "'" : ", '") + name + "'";
  if (!unknown.empty())
    throw std::invalid_argument("[lily] backend 'metal' has no option " + unknown + " (options: " + known_names() +
                                ")");
  const bool kv_bf16 = bool_option(options, "kv_bf16", true);
#if defined(LILY_METAL_EMULATED)
  auto libs = options.find("emu_kernel_libs");
  if (libs == options.end() || libs->second.empty())
    throw std::runtime_error(
        "[lily] backend 'metal' is built here over the emulated device only (for tests: no Apple GPU on this "
        "platform); pass options={'emu_kernel_libs': '<a.so>;<b.so>;...'} with the emulator builds of "
        "metal/*.metal (tools/msl/mslc.py), or use backend='cpu'");
  EmuOptions eo;
  eo.kernel_libs = libs->second;
  eo.schedule = static_cast<int>(int_option(options, "emu_schedule", -1, -1, 2));
  eo.threads = static_cast<int>(int_option(options, "emu_threads", 2, 1, 1024));
  eo.max_threads = static_cast<uint32_t>(int_option(options, "emu_max_threads", 1024, 32, 1024));
  eo.tensor_ops = bool_option(options, "emu_tensor_ops", false);
  eo.check_hazards = bool_option(options, "emu_check_hazards", true);
  if (auto it = options.find("emu_drop_barrier_before"); it != options.end()) eo.drop_barrier_before = it->second;
  return make_metal_backend(cfg, w, make_emulated_device(eo), debug, kv_bf16);
#else
  bool emu_requested = false;
  for (const auto& [name, value] : options) emu_requested |= name.rfind("emu_", 0) == 0;
  if (emu_requested)
    throw std::invalid_argument("[lily] backend 'metal': the emu_* options select the emulated device, which is "
                                "built into Linux installs only; this one runs the Apple device");
  return make_metal_backend(cfg, w, make_apple_device(), debug, kv_bf16);
#endif
}

}  // namespace lily::metal
