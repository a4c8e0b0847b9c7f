// Backend factory, beside the bindings: compiled into the extension module (not lily_core) so that LILY_HAVE_CUDA
// decides whether the CUDA backend is linked at all; core/ itself includes no backend and never sees a GPU header.
#include <stdexcept>

#include "core/backend.h"
#ifdef LILY_HAVE_METAL
#include "metal/backend_metal.h"
#endif

namespace lily {

std::unique_ptr<Backend> make_backend(const std::string& name, const Config& cfg, const Weights& w, int threads,
                                      bool debug, const BackendOptions& options) {
  if (name != "metal" && !options.empty())
    throw std::invalid_argument("[lily] backend '" + name + "' takes no options (got '" + options.begin()->first +
                                "')");
  if (name == "cpu") return make_cpu_backend(cfg, w, threads, debug);
  if (name == "cuda") {
#ifdef LILY_HAVE_CUDA
    return make_cuda_backend(cfg, w, debug);
#else
    throw std::runtime_error("[lily] backend 'cuda' is not built into this install (nvcc was not found at build "
                             "time); use backend='cpu'");
#endif
  }
  if (name == "metal") {
#ifdef LILY_HAVE_METAL
    // macOS: the Apple device; Linux: the emulated device for tests (options name its kernel libraries)
    return metal::make_metal_backend(cfg, w, options, debug);
#else
    throw std::runtime_error("[lily] backend 'metal' is not built into this install (macOS builds it with "
                             "LILY_METAL=ON, Linux builds over the emulator with LILY_METAL_EMULATED=ON); "
                             "use backend='cpu'");
#endif
  }
  throw std::invalid_argument("[lily] unknown backend '" + name + "': expected 'cpu', 'cuda' or 'metal'");
}

}  // namespace lily
