// Top-k magnitude selection with error feedback on CUDA, bit for bit reference.topk_select.
//
// 1. acc = x + source in x's dtype (source: residual_source, or the residual itself), written to (a
//    contiguous stand-in for) the residual, which is otherwise only written.
// 2. Exact: the k-th largest magnitude key by a three-level radix select (digits of bits 30..20, 19..9 and
//    8..0, one shared-memory histogram pass and one single-block scan per level, no host sync) gives the
//    threshold key t and how many keys equal to t are needed.
//    Approximate (exact=false, unless 2 * approx_sample_size(n, k) > n): t is the rank-th largest key of the
//    hashed stratified sample of reference._approx_threshold, and every key >= t is taken.
// 3. An order-preserving compaction (per-tile counts, their exclusive prefix sums, then per-warp ballots)
//    writes the values and ascending int32 indices and zeroes the selected residual entries in one pass.
//
// Only the CUDA kernel is registered here; the schema lives in fastcomm/ops.py and the CPU kernels and the
// Python module in module.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>

#include "comm/kernels.h"
#include "comm/topk_cuda_kernels.cuh"

namespace fastcomm {
namespace {

using namespace topk_cuda;

// A grid-stride launch for n elements: at most 8 blocks per SM of the current device.
int grid_for(int64_t n) {
  int device = 0;
  int sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, kThreads), int64_t{sms} * 8)));
}

// state = {threshold key, how many keys equal to it to take}, both on the device.
template <typename scalar_t>
void exact_threshold(const scalar_t* acc, int64_t n, int64_t k, const at::Tensor& state, cudaStream_t stream) {
  state.zero_();
  state.narrow(0, 1, 1).fill_(k);
  at::Tensor hist = at::empty({kBins}, state.options());
  auto* hist_ptr = reinterpret_cast<unsigned int*>(hist.data_ptr<int32_t>());
  int32_t* state_ptr = state.data_ptr<int32_t>();
  for (int level = 0; level < kLevels; ++level) {
    hist.zero_();
    digit_histogram_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(
        acc, n, state_ptr, kLevelPrefixMask[level], kLevelShift[level], kLevelDigitMask[level], hist_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    find_digit_kernel<<<1, kThreads, 0, stream>>>(hist_ptr, kLevelShift[level], state_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// state = {reference._approx_threshold, n}: every key equal to the threshold is taken.
template <typename scalar_t>
void approx_threshold(const scalar_t* acc, int64_t n, int64_t k, const at::Tensor& state, cudaStream_t stream) {
  const int64_t m = approx_sample_size(n, k);
  const int64_t rank = std::max<int64_t>(1, ceil_div(m * k, n));
  at::Tensor keys = at::empty({m}, state.options());
  sample_keys_kernel<scalar_t><<<grid_for(m), kThreads, 0, stream>>>(acc, m, n / m, keys.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The sample is small (about 1000 * n / k keys); ATen's topk on it is not the hot part.
  state.narrow(0, 0, 1).copy_(std::get<0>(at::topk(keys, rank)).narrow(0, rank - 1, 1));
  state.narrow(0, 1, 1).fill_(n);
}

template <typename scalar_t>
std::tuple<at::Tensor, at::Tensor> select_topk(const scalar_t* acc, scalar_t* residual, int64_t n, int64_t k,
                                          bool use_exact, const at::TensorOptions& value_options) {
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::TensorOptions int_options = value_options.dtype(at::kInt);
  at::Tensor state = at::empty({2}, int_options);
  if (use_exact) {
    exact_threshold(acc, n, k, state, stream);
  } else {
    approx_threshold(acc, n, k, state, stream);
  }
  const int64_t tiles = ceil_div(n, kTile);
  TORCH_CHECK(tiles <= std::numeric_limits<int32_t>::max(), "topk_select: too many tiles");
  at::Tensor counts = at::empty({2, tiles}, int_options);
  const int32_t* state_ptr = state.const_data_ptr<int32_t>();
  count_selected_kernel<scalar_t><<<static_cast<unsigned int>(tiles), kThreads, 0, stream>>>(
      acc, n, state_ptr, counts[0].data_ptr<int32_t>(), counts[1].data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor inclusive = at::cumsum(counts, 1, at::kInt);
  const at::Tensor offsets = (inclusive - counts).contiguous();
  // Exact mode sends exactly k; approximate mode sends every key >= t, which needs the one host sync.
  const int64_t count = use_exact ? k : inclusive.select(1, tiles - 1).sum().item<int64_t>();
  at::Tensor values = at::empty({count}, value_options);
  at::Tensor indices = at::empty({count}, int_options);
  write_selected_kernel<scalar_t><<<static_cast<unsigned int>(tiles), kThreads, 0, stream>>>(
      acc, residual, n, state_ptr, offsets[0].const_data_ptr<int32_t>(), offsets[1].const_data_ptr<int32_t>(),
      values.data_ptr<scalar_t>(), indices.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {values, indices};
}

std::tuple<at::Tensor, at::Tensor> topk_select_cuda(const at::Tensor& x, int64_t k,
                                                    const std::optional<at::Tensor>& residual, bool exact,
                                                    const std::optional<at::Tensor>& residual_source) {
  const int64_t n = x.numel();
  TORCH_CHECK(x.is_cuda(), "topk_select: x must be a CUDA tensor");
  TORCH_CHECK(k >= 0 && k <= n, "topk_select: k must be in [0, ", n, "], got ", k);
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(), "topk_select: int32 indices limit x to 2^31-1 elements");
  const bool has_residual = residual.has_value() && residual->defined();
  const bool has_source = residual_source.has_value() && residual_source->defined();
  TORCH_CHECK_VALUE(has_residual || !has_source,
                    "topk_select: residual_source needs residual (the buffer acc - sent is written to)");
  if (has_residual) {
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                          residual->device() == x.device(),
                      "topk_select: residual must match x in shape, dtype and device");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor flat = x.reshape(-1).contiguous();
  // The buffer acc is formed in and the residual is left in (a contiguous stand-in when the caller's is not),
  // and what acc = x + source reads: residual_source, or that buffer itself.
  at::Tensor work, source;
  if (has_residual) {
    if (has_source && !residual_source->is_same(*residual)) {
      TORCH_CHECK_VALUE(residual_source->sizes() == x.sizes() && residual_source->scalar_type() == x.scalar_type() &&
                            residual_source->device() == x.device(),
                        "topk_select: residual_source must match x in shape, dtype and device");
      work = residual->is_contiguous() ? residual->view(-1) : at::empty({n}, x.options());
      source = residual_source->reshape(-1).contiguous();
    } else {
      work = residual->is_contiguous() ? residual->view(-1) : residual->reshape(-1).contiguous();
      source = work;
    }
  }
  at::Tensor values, indices;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "topk_select_cuda", [&] {
    scalar_t* residual_ptr = has_residual ? work.data_ptr<scalar_t>() : nullptr;
    if (has_residual && n > 0) {
      accumulate_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(
          flat.const_data_ptr<scalar_t>(), source.const_data_ptr<scalar_t>(), residual_ptr, n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const scalar_t* acc = has_residual ? residual_ptr : flat.const_data_ptr<scalar_t>();
    if (k == 0 || n == 0) {
      values = at::empty({0}, x.options());
      indices = at::empty({0}, x.options().dtype(at::kInt));
    } else {
      const bool use_exact = exact || approx_sample_size(n, k) * 2 > n;
      std::tie(values, indices) = select_topk(acc, residual_ptr, n, k, use_exact, x.options());
    }
  });
  if (has_residual && !residual->is_contiguous()) residual->copy_(work.view(residual->sizes()));
  return {values, indices};
}

}  // namespace
}  // namespace fastcomm

TORCH_LIBRARY_IMPL(fastcomm, CUDA, m) { m.impl("topk_select", &fastcomm::topk_select_cuda); }
