// The emulated device's runtime compile (Linux): the same entry point as Apple's newLibraryWithSource path
// (device_mtl.mm), over the project's MSL toolchain. The embedded kernel texts (kernel_sources.h, headers
// inlined) are written to <cache>/emu-src/<hash of the file's text>/<file> and built by `tools/msl/mslc.py build-embedded`
// (g++ against the MSL shim, one shared library per file, cached by the hash of each translation unit in
// <cache>/msl-build), then validated: every kernel a file declares must be in its library. A failure
// throws MetalUnavailable naming the file and the compiler's diagnostics, as on Apple.
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "metal/device.h"
#include "metal/kernel_sources.h"

#ifndef LILY_MSL_TOOLCHAIN_DEFAULT
#define LILY_MSL_TOOLCHAIN_DEFAULT ""
#endif

namespace lily::metal {
namespace {

bool exists(const std::string& p) {
  struct stat st;
  return !p.empty() && stat(p.c_str(), &st) == 0;
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// The interpreter to run mslc.py with: the option, $LILY_PYTHON, this process if it is a Python, else python3.
std::string python_command(const std::string& configured) {
  if (!configured.empty()) return configured;
  if (const char* e = std::getenv("LILY_PYTHON"); e && *e) return e;
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n > 0) {
    const std::string exe(buf, static_cast<size_t>(n));
    if (exe.substr(exe.rfind('/') + 1).rfind("python", 0) == 0) return exe;
  }
  return "python3";
}

std::string toolchain_path(const std::string& configured) {
  std::string p = configured;
  if (p.empty() && std::getenv("LILY_MSLC")) p = std::getenv("LILY_MSLC");
  if (p.empty()) p = LILY_MSL_TOOLCHAIN_DEFAULT;
  if (!exists(p))
    throw MetalUnavailable("the emulated device compiles kernels with tools/msl/mslc.py, which is not at '" + p +
                           "': pass the backend option emu_toolchain=<path of mslc.py> or set LILY_MSLC");
  return p;
}

}  // namespace

EmuLibraries compile_embedded_for_emulator(const EmuCompileOptions& o) {
  const std::vector<KernelSource> sources = kernel_sources(o.planted_error);
  const std::string hash = sources_hash(sources);
  const std::string cache = cache_dir(o.cache_dir);
  const std::string src_root = cache + "/emu-src";
  std::string cmd = "MSL_BUILD_DIR=" + quote(cache + "/msl-build") + " MSL_JOBS=" + std::to_string(o.jobs) + " " +
                    quote(python_command(o.python)) + " " + quote(toolchain_path(o.toolchain)) + " build-embedded";
  std::map<std::string, const KernelSource*> by_path;
  for (const KernelSource& k : sources) {
    // one folder per file text, so a file that did not change keeps its path and mslc.py's cached build
    // (its key covers the translation unit, which names the path) when another file changes
    const std::string dir = src_root + "/" + sources_hash({k});
    if (!ensure_dir(dir)) throw std::runtime_error("[lily] metal: cannot create the kernel cache folder " + dir);
    const std::string path = dir + "/" + k.file;
    if (!exists(path) || read_text(path) != k.text) write_file_atomic(path, k.text);
    by_path[path] = &k;
    cmd += " " + quote(path);
  }
  const std::string tool_log = src_root + "/toolchain-" + hash + ".log";
  cmd += " 2>" + quote(tool_log);

  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) throw MetalUnavailable("could not start the emulator's toolchain: " + cmd);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  const int rc = pclose(pipe);
  if (rc != 0)
    throw MetalUnavailable("the emulator's toolchain failed (exit status " + std::to_string(rc) + "): " + cmd +
                           "\n" + read_text(tool_log));

  EmuLibraries res;
  std::vector<CompileFailure> failures;
  bool all_cached = true;
  std::map<std::string, bool> answered;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    std::vector<std::string> f;
    std::istringstream cols(line);
    for (std::string c; std::getline(cols, c, '\t');) f.push_back(c);
    if (f.size() < 3 || !by_path.count(f[1])) continue;
    const KernelSource& ks = *by_path[f[1]];
    answered[f[1]] = true;
    if (f[0] != "ok") {
      failures.push_back({ks.file, read_text(f[2])});
      continue;
    }
    all_cached &= f.size() > 3 && f[3] == "cached";
    // validation: the library loads and has every kernel the file declares (Apple: functionNames)
    void* h = dlopen(f[2].c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      failures.push_back({ks.file, std::string("the compiled library does not load: ") + dlerror()});
      continue;
    }
    std::string missing;
    for (const std::string& name : ks.kernels)
      if (!dlsym(h, ("__msl_launch_" + name).c_str())) missing += " " + name;
    dlclose(h);
    if (!missing.empty()) failures.push_back({ks.file, "validation: kernels missing from the compiled library:" + missing});
    res.kernel_libs += (res.kernel_libs.empty() ? "" : ";") + f[2];
  }
  for (const auto& [path, ks] : by_path)
    if (!answered.count(path)) failures.push_back({ks->file, "the toolchain gave no result for this file:\n" + out});
  if (!failures.empty()) throw_compile_failures(failures, "tools/msl/mslc.py, g++ against the MSL shim");
  res.report.origin = "embedded sources, compiled at run time (tools/msl/mslc.py for the emulator)";
  res.report.source_hash = hash;
  res.report.cache = cache;
  res.report.cache_hit = all_cached;
  return res;
}

}  // namespace lily::metal
