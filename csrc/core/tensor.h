// Non-owning views of host memory (weights are zero-copy views of memory-mapped files).
#pragma once
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace lily {

// U16 carries bf16 bit patterns (NumPy has no bfloat16).
enum class DType { F32, U16, U32, I32, Other };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::U16: return "uint16(bf16)";
    case DType::U32: return "uint32";
    case DType::I32: return "int32";
    default: return "other";
  }
}

struct TensorView {
  const void* ptr = nullptr;
  DType dtype = DType::Other;
  std::vector<int64_t> shape;

  int64_t numel() const {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
};

using TensorMap = std::map<std::string, TensorView>;
using QuantMap = std::map<std::string, std::pair<int, int>>;  // module -> (bits, group_size)

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A linear layer y = x W^T with W of logical shape [out, in] (per expert when experts > 0).
// Quantized (MLX affine): codes [E?, out, in*bits/32] u32, scales/biases [E?, out, in/group] bf16.
// Dense: weight [E?, out, in] bf16 or f32.
struct Linear {
  enum class Kind { None, Quant, DenseBF16, DenseF32 };
  Kind kind = Kind::None;
  int bits = 0, group = 0;
  int64_t out = 0, in = 0;
  int64_t experts = 0;  // 0 = not stacked
  const uint32_t* codes = nullptr;
  const uint16_t* scales = nullptr;
  const uint16_t* biases = nullptr;
  const void* dense = nullptr;

  int64_t words_per_row() const { return in * bits / 32; }
  int64_t groups_per_row() const { return group ? in / group : 0; }

  // View of expert e of a stacked weight: [out, in].
  Linear expert(int64_t e) const {
    Linear l = *this;
    l.experts = 0;
    if (kind == Kind::Quant) {
      l.codes = codes + e * out * words_per_row();
      l.scales = scales + e * out * groups_per_row();
      l.biases = biases + e * out * groups_per_row();
    } else if (kind == Kind::DenseBF16) {
      l.dense = static_cast<const uint16_t*>(dense) + e * out * in;
    } else if (kind == Kind::DenseF32) {
      l.dense = static_cast<const float*>(dense) + e * out * in;
    }
    return l;
  }
};

}  // namespace lily
