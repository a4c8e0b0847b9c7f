// The embedded kernel sources (kernel_sources.h): include inlining, the planted compile error, the source
// hash, the cache folder, and the "Metal unavailable" error both devices raise.
#include "metal/kernel_sources.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

namespace lily::metal {
namespace {

const EmbeddedSource* embedded(const std::string& path) {
  for (size_t i = 0; i < kEmbeddedSourceCount; ++i)
    if (path == kEmbeddedSources[i].path) return &kEmbeddedSources[i];
  return nullptr;
}

std::string dir_of(const std::string& path) {
  const size_t s = path.rfind('/');
  return s == std::string::npos ? std::string() : path.substr(0, s + 1);
}

bool is_pragma_once(const std::string& line) {
  std::string s;
  for (char c : line)
    if (c != ' ' && c != '\t') s += c;
  return s.rfind("#pragmaonce", 0) == 0;
}

// `#include "x"` -> x, else "" (system includes <...> stay for the compiler).
std::string quoted_include(const std::string& line) {
  size_t i = line.find_first_not_of(" \t");
  if (i == std::string::npos || line[i] != '#') return "";
  i = line.find_first_not_of(" \t", i + 1);
  if (i == std::string::npos || line.compare(i, 7, "include") != 0) return "";
  const size_t a = line.find('"', i + 7);
  const size_t b = a == std::string::npos ? a : line.find('"', a + 1);
  return b == std::string::npos ? "" : line.substr(a + 1, b - a - 1);
}

// Resolved as mslc.py does: next to the including file, then metal/, then csrc/.
void inline_into(const std::string& path, std::set<std::string>& once, std::string& out) {
  const EmbeddedSource* src = embedded(path);
  if (!src) throw std::logic_error("[lily] metal: embedded source '" + path + "' missing");
  std::istringstream in(src->text);
  std::string line;
  int n = 0;
  out += "#line 1 \"" + path + "\"\n";
  while (std::getline(in, line)) {
    ++n;
    if (is_pragma_once(line)) {
      once.insert(path);
      out += "\n";
      continue;
    }
    const std::string inc = quoted_include(line);
    if (inc.empty()) {
      out += line + "\n";
      continue;
    }
    std::string found;
    for (const std::string& cand : {dir_of(path) + inc, "metal/" + inc, "csrc/" + inc})
      if (embedded(cand)) {
        found = cand;
        break;
      }
    if (found.empty())
      throw std::logic_error("[lily] metal: " + path + ":" + std::to_string(n) + " includes \"" + inc +
                             "\", which is not among the embedded sources (csrc/metal/metal.cmake lists them)");
    if (!once.count(found)) inline_into(found, once, out);
    out += "#line " + std::to_string(n + 1) + " \"" + path + "\"\n";
  }
}

// Host names a kernel file declares: every [[host_name("x")]] and every non-template `kernel void x(`.
std::vector<std::string> declared_kernels(const std::string& text) {
  std::vector<std::string> names;
  std::istringstream in(text);
  std::string line, prev;
  while (std::getline(in, line)) {
    for (size_t p = line.find("host_name(\""); p != std::string::npos; p = line.find("host_name(\"", p + 1)) {
      const size_t a = p + 11, b = line.find('"', a);
      if (b != std::string::npos) names.push_back(line.substr(a, b - a));
    }
    const size_t k = line.find_first_not_of(" \t");
    if (k != std::string::npos && line.compare(k, 12, "kernel void ") == 0 && prev.rfind("template", 0) != 0) {
      const size_t a = k + 12, b = line.find('(', a);
      if (b != std::string::npos) names.push_back(line.substr(a, b - a));
    }
    const size_t f = line.find_first_not_of(" \t");
    if (f != std::string::npos && line.compare(f, 2, "//") != 0) prev = line.substr(f);
  }
  return names;
}

}  // namespace

bool ensure_dir(const std::string& path) {
  for (size_t p = 1; p <= path.size(); ++p) {
    if (p < path.size() && path[p] != '/') continue;
    const std::string sub = path.substr(0, p);
    if (mkdir(sub.c_str(), 0755) != 0 && errno != EEXIST) return false;
  }
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::vector<KernelSource> kernel_sources(const std::string& planted_error) {
  std::vector<KernelSource> out;
  std::string planted = planted_error;
  if (!planted.empty() && planted.find('.') == std::string::npos) planted += ".metal";
  bool planted_found = planted.empty();
  for (size_t i = 0; i < kEmbeddedSourceCount; ++i) {
    const std::string path = kEmbeddedSources[i].path;
    if (path.rfind("metal/", 0) != 0 || path.size() < 7 || path.compare(path.size() - 6, 6, ".metal") != 0) continue;
    KernelSource ks;
    ks.file = path.substr(6);
    std::set<std::string> once;
    inline_into(path, once, ks.text);
    ks.kernels = declared_kernels(kEmbeddedSources[i].text);
    if (ks.file == planted) {
      // a syntax error, so every compiler rejects the file with its own diagnostics
      ks.text += "// planted compile error (option inject_compile_error)\nint lily_planted_syntax_error = ;\n";
      planted_found = true;
    }
    out.push_back(std::move(ks));
  }
  if (!planted_found) {
    std::string names;
    for (const KernelSource& k : out) names += (names.empty() ? "" : ", ") + k.file;
    throw std::invalid_argument("[lily] backend 'metal': inject_compile_error='" + planted_error +
                                "' names no embedded kernel file (files: " + names + ")");
  }
  return out;
}

const KernelSource* find_source(const std::vector<KernelSource>& all, const std::string& file) {
  for (const KernelSource& k : all)
    if (k.file == file) return &k;
  return nullptr;
}

std::string sources_hash(const std::vector<KernelSource>& all) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const std::string& s) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;  // separator: ("ab","c") != ("a","bc")
  };
  for (const KernelSource& k : all) {
    mix(k.file);
    mix(k.text);
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string cache_dir(const std::string& configured) {
  std::string dir = configured;
  const char* home = std::getenv("HOME");
  if (dir.empty() && std::getenv("LILY_CACHE_DIR") && *std::getenv("LILY_CACHE_DIR"))
    dir = std::string(std::getenv("LILY_CACHE_DIR")) + "/metal";
#if defined(__APPLE__)
  if (dir.empty() && home) dir = std::string(home) + "/Library/Caches/lily/metal";
#else
  if (dir.empty() && std::getenv("XDG_CACHE_HOME") && *std::getenv("XDG_CACHE_HOME"))
    dir = std::string(std::getenv("XDG_CACHE_HOME")) + "/lily/metal";
  if (dir.empty() && home) dir = std::string(home) + "/.cache/lily/metal";
#endif
  if (dir.empty())
    throw std::runtime_error("[lily] metal: no cache folder for compiled kernels (HOME is not set): pass the backend "
                             "option cache_dir or set LILY_CACHE_DIR");
  if (!ensure_dir(dir))
    throw std::runtime_error("[lily] metal: cannot create the kernel cache folder " + dir + " (" +
                             std::strerror(errno) + "): pass the backend option cache_dir or set LILY_CACHE_DIR");
  return dir;
}

void write_file_atomic(const std::string& path, const std::string& data) {
  const std::string tmp = path + "." + std::to_string(getpid()) + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary);
    f << data;
    if (!f) throw std::runtime_error("[lily] metal: cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error("[lily] metal: cannot rename " + tmp + " to " + path);
  }
}

void throw_compile_failures(const std::vector<CompileFailure>& failures, const std::string& compiler) {
  std::string names, body;
  for (const CompileFailure& f : failures) {
    names += (names.empty() ? "" : ", ") + f.file;
    body += "--- " + f.file + " (" + compiler + "):\n" + f.diagnostics;
    if (!body.empty() && body.back() != '\n') body += "\n";
  }
  throw MetalUnavailable("kernel " + std::string(failures.size() == 1 ? "file " : "files ") + names +
                         " failed to compile or validate; the compiler said:\n" + body);
}

}  // namespace lily::metal
