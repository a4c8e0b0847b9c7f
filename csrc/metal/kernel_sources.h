// The Metal kernel sources as the extension carries them (issue 16): metal/*.metal and the headers they
// include, embedded as text at build time (embed_sources.cmake), compiled at first use by the device
// (Apple: MTLDevice newLibraryWithSource; Linux: the emulator's toolchain, tools/msl/mslc.py). Shared by
// both devices, so the error a failed compile produces, and the fallback it triggers, are the same code.
#pragma once
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace lily::metal {

struct EmbeddedSource {
  const char* path;  // relative to the repository: "metal/gemv.metal", "metal/common.h", "csrc/kernels/params.h"
  const char* text;
};
extern const EmbeddedSource kEmbeddedSources[];  // generated (embed_sources.cmake)
extern const size_t kEmbeddedSourceCount;

// One kernel file ready to compile: its quoted includes inlined from the embedded headers (#pragma once
// honoured), with #line markers naming the original files, so a compiler's diagnostics point at
// metal/<file>:<line>. Needs no file system: Apple's newLibraryWithSource resolves no includes.
struct KernelSource {
  std::string file;  // "gemv.metal"
  std::string text;
  std::vector<std::string> kernels;  // host names it declares (validation: each must be in the compiled library)
};

// Every embedded metal/*.metal file. planted_error (tests, and a Mac user checking the fallback): the name
// of one kernel file ("gemv.metal" or "gemv") whose text gets a syntax error appended before compiling;
// std::invalid_argument when no such file is embedded.
std::vector<KernelSource> kernel_sources(const std::string& planted_error = "");
const KernelSource* find_source(const std::vector<KernelSource>& all, const std::string& file);

// FNV-1a 64 over every kernel file's compiled text, hex: the cache key of compiled libraries and pipelines.
std::string sources_hash(const std::vector<KernelSource>& all);

// The folder compiled kernels are cached in: `configured` if not empty, else $LILY_CACHE_DIR/metal, else
// (Apple) ~/Library/Caches/lily/metal, (elsewhere) $XDG_CACHE_HOME/lily/metal or ~/.cache/lily/metal.
// Created (with parents) if missing; std::runtime_error when it cannot be.
std::string cache_dir(const std::string& configured);
bool ensure_dir(const std::string& path);  // mkdir -p; false when it cannot be made
void write_file_atomic(const std::string& path, const std::string& data);  // temp file + rename

// A kernel file that did not compile or validate, with the compiler's diagnostics.
struct CompileFailure {
  std::string file;         // "gemv.metal"
  std::string diagnostics;  // the compiler's output, or what validation found missing
};

// "Metal unavailable": no device, or kernels that did not compile / validate. The message starts with
// kUnavailablePrefix, which lily.model maps to lily.BackendUnavailableError (backend="metal") or to the
// CPU fallback with a warning (backend="auto").
inline constexpr const char* kUnavailablePrefix = "[lily] backend 'metal' unavailable: ";
class MetalUnavailable : public std::runtime_error {
 public:
  explicit MetalUnavailable(const std::string& what) : std::runtime_error(kUnavailablePrefix + what) {}
};
// Throws MetalUnavailable naming every failed kernel file with its diagnostics (`compiler` says which
// compiler ran: "newLibraryWithSource", "tools/msl/mslc.py (emulator)").
[[noreturn]] void throw_compile_failures(const std::vector<CompileFailure>& failures, const std::string& compiler);

// How the device got its kernels, for `lily info` and the tests.
struct LibraryReport {
  std::string origin;       // "embedded sources, compiled at run time" | "build-time lily.metallib" | ...
  std::string source_hash;  // sources_hash() of what was compiled ("" for prebuilt emulator libraries)
  std::string cache;        // where compiled results are cached
  bool cache_hit = false;   // nothing had to be compiled
  std::string tensor_ops;   // "on", or why off
};

}  // namespace lily::metal
