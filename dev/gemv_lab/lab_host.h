// gemv_lab host side: random MLX-layout weights, the fp64 CPU reference, the kernels' arithmetic emulated on
// the host, the model's decode shapes, the --cpu-only self-test. Included by gemv_lab.cu after Fmt<>.
#pragma once
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {  // xorshift64*
    s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
    return s * 0x2545F4914F6CDD1Dull;
  }
  float uni() { return static_cast<float>(next() >> 40) * (1.f / 16777216.f); }
};
static uint16_t f2bf(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static double bf2d(uint16_t h) { return static_cast<double>(bf16f(h)); }

struct Mat {  // one tensor, possibly a stack of `experts` matrices [experts][rows][in]
  int64_t experts = 1, rows = 0, in = 0;
  int bits = 4;
  std::vector<uint32_t> codes;
  std::vector<uint16_t> scales, biases;
  int64_t words() const { return experts * rows * in * bits / 32; }
  int64_t groups() const { return experts * rows * in / kGroup; }
  void fill(Rng& r) {
    codes.resize(words());
    scales.resize(groups());
    biases.resize(groups());
    for (auto& c : codes) c = static_cast<uint32_t>(r.next() >> 17);
    const float qmid = bits == 4 ? 7.5f : 127.5f;
    for (int64_t i = 0; i < groups(); ++i) {  // like an affine fit of ~N(0, 0.02) weights
      const float s = (0.03f + 0.02f * r.uni()) / (2 * qmid);
      scales[i] = f2bf(s);
      biases[i] = f2bf(-s * qmid * (0.9f + 0.2f * r.uni()));
    }
  }
};
struct PartSpec {
  int mat;
  int64_t rows;  // rows this part contributes (row parts) or the common rows (K parts)
  int slot;      // -1: plain; >= 0: expert slot
  float fac;     // K parts: routing weight
};
struct Shape {
  std::string name, note;
  int bits = 4;
  int64_t in = 2048;  // inputs per row of one part
  bool kcat = false;  // parts along K
  std::vector<Mat> mats;
  std::vector<PartSpec> parts;
  int64_t rows() const {
    if (kcat) return parts[0].rows;
    int64_t r = 0;
    for (auto& p : parts) r += p.rows;
    return r;
  }
  int64_t xlen() const { return kcat ? in * static_cast<int64_t>(parts.size()) : in; }
  int64_t bytes() const {  // bytes one launch streams: codes + scales + biases of the rows it reads
    int64_t b = 0;
    for (auto& p : parts) b += p.rows * in * bits / 8 + p.rows * (in / kGroup) * 4;
    return b;
  }
};

// Fixed-matrix row (expert e, row r) of a part: pointers into the host arrays.
static void host_row(const Mat& M, int64_t e, int64_t r, const uint32_t*& c, const uint16_t*& s, const uint16_t*& b) {
  const int64_t row = e * M.rows + r;
  c = M.codes.data() + row * (M.in * M.bits / 32);
  s = M.scales.data() + row * (M.in / kGroup);
  b = M.biases.data() + row * (M.in / kGroup);
}
static int code_at(const uint32_t* c, int bits, int64_t k) {
  const int per = 32 / bits;
  return static_cast<int>((c[k / per] >> (bits * (k % per))) & ((1u << bits) - 1u));
}
// y[r] in fp64 by groups: s * sum(q x) + b * sum(x) (naive = false), or by dequantising every weight first
// (naive = true: the self-test's independent form).
static void cpu_reference(const Shape& S, const std::vector<uint16_t>& x, const std::vector<int>& ids,
                          std::vector<double>& y, bool naive) {
  const int64_t rows = S.rows();
  y.assign(rows, 0.0);
  auto row_dot = [&](const PartSpec& P, int64_t r, const uint16_t* xs) {
    const Mat& M = S.mats[P.mat];
    const uint32_t* c;
    const uint16_t *s, *b;
    host_row(M, P.slot >= 0 ? ids[P.slot] : 0, r, c, s, b);
    double acc = 0;
    for (int64_t g = 0; g < S.in / kGroup; ++g) {
      double dq = 0, dx = 0, dn = 0;
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
        const double xv = bf2d(xs[k]), q = code_at(c, S.bits, k);
        if (naive) dn += (bf2d(s[g]) * q + bf2d(b[g])) * xv;
        dq += q * xv, dx += xv;
      }
      acc += naive ? dn : bf2d(s[g]) * dq + bf2d(b[g]) * dx;
    }
    return acc;
  };
  auto work = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (S.kcat) {
        double v = 0;
        for (size_t p = 0; p < S.parts.size(); ++p)
          v += static_cast<double>(S.parts[p].fac) * row_dot(S.parts[p], r, x.data() + p * S.in);
        y[r] = v;
      } else {
        int64_t base = 0;
        size_t p = 0;
        while (r >= base + S.parts[p].rows) base += S.parts[p++].rows;
        y[r] = row_dot(S.parts[p], r - base, x.data());
      }
    }
  };
  const int nt = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
  std::vector<std::thread> th;
  for (int t = 0; t < nt; ++t) th.emplace_back(work, rows * t / nt, rows * (t + 1) / nt);
  for (auto& t : th) t.join();
}

// The kernels' per-lane arithmetic on the host (same word_dot, same Cx/Sx, fp32), lanes summed in fp32:
// checks the magic-number dequantisation and its precision without a GPU.
template <int BITS>
static void emulate_kernel(const Shape& S, const std::vector<uint16_t>& x, const std::vector<int>& ids,
                           std::vector<double>& y) {
  using F = Fmt<BITS>;
  const int64_t rows = S.rows(), cpart = S.in / F::CW;
  y.assign(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    float sum = 0.f;
    for (size_t p = 0; p < S.parts.size(); ++p) {
      const PartSpec& P = S.parts[p];
      int64_t lr = r;
      if (!S.kcat) {
        int64_t base = 0;
        size_t pp = 0;
        while (r >= base + S.parts[pp].rows) base += S.parts[pp++].rows;
        if (pp != p) continue;
        lr = r - base;
      }
      const uint32_t* c;
      const uint16_t *s, *b;
      host_row(S.mats[P.mat], P.slot >= 0 ? ids[P.slot] : 0, lr, c, s, b);
      const float fac = S.kcat ? P.fac : 1.f;
      const uint16_t* xs = x.data() + (S.kcat ? p * S.in : 0);
      for (int64_t ch = 0; ch < cpart; ++ch) {
        float xp[F::CW], cx = 0.f, sx = 0.f, acc = 0.f;
        for (int j = 0; j < F::CW; ++j) {
          xp[j] = bf16f(xs[ch * F::CW + j]) * fac * F::prescale(j % F::VPW);
          cx += xp[j], sx += xp[j] / F::prescale(j % F::VPW);
        }
        for (int w = 0; w < 4; ++w) acc = F::word_dot(c[ch * 4 + w], xp + w * F::VPW, acc);
        const int64_t g = ch / F::CPG;
        sum += std::fmaf(bf16f(s[g]), acc - cx, bf16f(b[g]) * sx);
      }
    }
    y[r] = sum;
  }
}

template <typename T>
static double rel_rms(const std::vector<T>& y, const std::vector<double>& ref, bool* nan) {
  double num = 0, den = 0;
  *nan = false;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(y[i])) *nan = true;
    const double d = y[i] - ref[i];
    num += d * d, den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The decode projections of Qwen3.6-35B-A3B (hidden 2048; DeltaNet qkv 8192 + z 4096 + b 32 + a 32 rows;
// attention q 16 heads x (256 q + 256 gate) = 8192, k/v 2 x 256; 256 experts, 8 routed, intermediate 512,
// 1 shared expert; router 8-bit; vocab 248320). Fused as lily's decode step launches them.
static std::vector<Shape> model_shapes(float scale_rows = 1.f) {
  auto R = [&](int64_t r) { return std::max<int64_t>(kR, static_cast<int64_t>(r * scale_rows) / kR * kR); };
  auto mat = [](int64_t rows, int64_t in, int bits = 4, int64_t experts = 1) {
    Mat m;
    m.rows = rows, m.in = in, m.bits = bits, m.experts = experts;
    return m;
  };
  std::vector<Shape> v;
  auto dense = [&](const char* name, const char* note, int bits, int64_t in, std::vector<int64_t> rows) {
    Shape s;
    s.name = name, s.note = note, s.bits = bits, s.in = in;
    for (size_t i = 0; i < rows.size(); ++i) {
      s.mats.push_back(mat(R(rows[i]), in, bits));
      s.parts.push_back({static_cast<int>(i), R(rows[i]), -1, 1.f});
    }
    v.push_back(s);
  };
  dense("dn_in", "DeltaNet qkv+z+b+a", 4, 2048, {8192, 4096, 32, 32});
  dense("dn_out", "DeltaNet out", 4, 4096, {2048});
  dense("attn_qkv", "attention q+k+v", 4, 2048, {8192, 512, 512});
  dense("attn_kv1", "attention k alone", 4, 2048, {512});
  dense("attn_o", "attention o", 4, 4096, {2048});
  dense("router", "router, 8-bit", 8, 2048, {256});
  dense("sh_gate_up", "shared expert gate+up", 4, 2048, {512, 512});
  dense("sh_down", "shared expert down", 4, 512, {2048});
  {
    Shape s;  // 8 slots x {gate, up}, rows gathered by expert id from [256, 512, 2048] stacks
    s.name = "moe_gate_up", s.note = "8 experts gate+up, gathered";
    s.mats.push_back(mat(R(512), 2048, 4, 256));
    s.mats.push_back(mat(R(512), 2048, 4, 256));
    for (int j = 0; j < 8; ++j) {
      s.parts.push_back({0, R(512), j, 1.f});
      s.parts.push_back({1, R(512), j, 1.f});
    }
    v.push_back(s);
  }
  {
    Shape s;  // K-concatenated: 8 routed experts' down rows (x = act_j * w_j) + the shared expert's
    s.name = "moe_down", s.note = "8 experts down + shared, weighted sum";
    s.in = 512, s.kcat = true;
    s.mats.push_back(mat(R(2048), 512, 4, 256));
    s.mats.push_back(mat(R(2048), 512, 4, 1));
    for (int j = 0; j < 8; ++j) s.parts.push_back({0, R(2048), j, 0.f});
    s.parts.push_back({1, R(2048), -1, 0.f});
    v.push_back(s);
  }
  dense("lm_head", "lm_head", 4, 2048, {248320});
  return v;
}

static void fill_inputs(Shape& S, Rng& rng, std::vector<uint16_t>& x, std::vector<int>& ids) {
  for (auto& m : S.mats) m.fill(rng);
  x.resize(S.xlen());
  for (auto& v : x) v = f2bf(2.f * rng.uni() - 1.f);
  ids.clear();  // 8 distinct experts
  while (ids.size() < 8) {
    const int e = static_cast<int>(rng.next() % 256);
    if (std::find(ids.begin(), ids.end(), e) == ids.end()) ids.push_back(e);
  }
  if (S.kcat) {  // routing weights (normalised over the 8) and the shared expert's sigmoid gate
    float tot = 0;
    for (int j = 0; j < 8; ++j) tot += (S.parts[j].fac = 0.2f + rng.uni());
    for (int j = 0; j < 8; ++j) S.parts[j].fac /= tot;
    S.parts[8].fac = 1.f / (1.f + std::exp(-(2.f * rng.uni() - 1.f)));
  }
}

static int cpu_self_test() {
  int fails = 0;
  for (Shape S : model_shapes(1.f / 64)) {  // every shape's structure at 1/64 of its rows
    Rng rng(7);
    std::vector<uint16_t> x;
    std::vector<int> ids;
    fill_inputs(S, rng, x, ids);
    std::vector<double> ref, naive, emu;
    cpu_reference(S, x, ids, ref, false);
    cpu_reference(S, x, ids, naive, true);
    if (S.bits == 4) emulate_kernel<4>(S, x, ids, emu);
    else emulate_kernel<8>(S, x, ids, emu);
    bool n1, n2;
    const double e1 = rel_rms(naive, ref, &n1), e2 = rel_rms(emu, ref, &n2);
    const bool ok = !n1 && !n2 && e1 < 1e-12 && e2 <= 2e-3;
    std::printf("cpu-only %-12s rows %7lld  ref vs naive dequant %.2e  kernel arithmetic (host) vs ref %.2e  %s\n",
                S.name.c_str(), static_cast<long long>(S.rows()), e1, e2, ok ? "ok" : "FAIL");
    fails += !ok;
  }
  {  // the magic-number dequantisation of single codes, every nibble position and byte position
    bool ok = true;
    for (uint32_t q = 0; q < 16; ++q)
      for (int j = 0; j < 8; ++j) {
        float xp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        xp[j] = Fmt<4>::prescale(j);
        const float got = Fmt<4>::word_dot(q << (4 * j), xp, 0.f) - xp[j];
        ok &= got == static_cast<float>(q);
      }
    for (uint32_t q = 0; q < 256; ++q)
      for (int j = 0; j < 4; ++j) {
        float xp[4] = {0, 0, 0, 0};
        xp[j] = Fmt<8>::prescale(j);
        ok &= Fmt<8>::word_dot(q << (8 * j), xp, 0.f) - xp[j] == static_cast<float>(q);
      }
    std::printf("cpu-only single-code dequant (4-bit x 8 positions, 8-bit x 4): %s\n", ok ? "ok" : "FAIL");
    fails += !ok;
  }
  std::printf("%d passed, %d failed\n", static_cast<int>(model_shapes().size()) + 1 - fails, fails);
  return fails ? 1 : 0;
}
