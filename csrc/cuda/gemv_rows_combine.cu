// The MoE combine after the M-row experts' down (gemv_rows.cuh's moe_combine).
#include <stdexcept>

#include "cuda/gemv_rows.cuh"

namespace lily::cuda::rows {

namespace {
// x[m][r] += sum_j w[m][j] yx[m][j][r] + sigmoid(g[m]) ysh[m][r]: the slots in order, then the shared expert, one thread
// an output (row r of input row m), so each row's sums are the one-row launch's.
__global__ void combine_kernel(const CombineArgs a) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
  pdl_trigger();
  pdl_wait();
  if (r >= a.H) return;
  const int64_t H = a.H;
  float acc = 0.f;
  for (int j = 0; j < a.k; ++j) acc = fmaf(a.top_w[m * a.k + j], a.yx[(static_cast<int64_t>(m) * a.k + j) * H + r], acc);
  if (a.ysh) acc = fmaf(1.f / (1.f + expf(-a.sgate[m])), a.ysh[m * H + r], acc);
  a.x[m * H + r] += acc;
}
}  // namespace

void moe_combine(cudaStream_t st, const CombineArgs& a) {
  if (a.M < 1 || a.M > kMaxRows || a.k < 1 || a.k > kMaxTopK || a.H < 1)
    throw std::invalid_argument("[lily] cuda rows moe combine: M 1 to 8, top_k 1 to 16, H >= 1");
  if (!a.yx || !a.top_w || !a.x || (a.ysh && !a.sgate))
    throw std::invalid_argument("[lily] cuda rows moe combine: yx, top_w and x (and sgate with ysh)");
  constexpr int kThreads = 256;
  launch_pdl(combine_kernel, dim3((a.H + kThreads - 1) / kThreads, a.M), dim3(kThreads), 0, st, a);
}

}  // namespace lily::cuda::rows
