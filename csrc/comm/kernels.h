// Declarations of the CPU kernels of fastcomm's ops and the small helpers they share.
// The schemas live in fastcomm/ops.py; the specification every kernel reproduces is fastcomm/reference.py.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

#include "comm/hash.h"

namespace fastcomm {

// Order key of |v|: the bit pattern of fabs(float(v)) as an unsigned int (NaN above +inf).
inline uint32_t magnitude_key(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits & 0x7FFFFFFFu;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Must equal reference.approx_sample_size.
inline int64_t approx_sample_size(int64_t n, int64_t k) {
  if (k <= 0) return 0;
  const int64_t wanted = std::max<int64_t>(65536, ceil_div(1000 * n, k));
  return std::min(n, wanted);
}

std::tuple<at::Tensor, at::Tensor> topk_select_cpu(const at::Tensor& x, int64_t k,
                                                   const std::optional<at::Tensor>& residual, bool exact,
                                                   const std::optional<at::Tensor>& residual_source);
std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cpu(const at::Tensor& x, int64_t bits, int64_t block,
                                                          bool stochastic, int64_t seed,
                                                          const std::optional<at::Tensor>& residual,
                                                          const std::optional<at::Tensor>& residual_source);
at::Tensor dequantize_blockwise_cpu(const at::Tensor& codes, const at::Tensor& scales, int64_t numel,
                                    int64_t bits, int64_t block, at::ScalarType dtype);
void dequantize_blockwise_into_cpu(const at::Tensor& out, const at::Tensor& codes, const at::Tensor& scales,
                                   int64_t bits, int64_t block, bool accumulate);
std::tuple<at::Tensor, at::Tensor> sign_compress_cpu(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                     int64_t chunk, const std::optional<at::Tensor>& residual_source);
at::Tensor sign_decompress_cpu(const at::Tensor& packed, const at::Tensor& scales, int64_t numel, int64_t chunk,
                               at::ScalarType dtype);
void sign_decompress_into_cpu(const at::Tensor& out, const at::Tensor& packed, const at::Tensor& scales,
                              int64_t chunk, bool accumulate);
void sparse_accumulate_cpu(const at::Tensor& out, const at::Tensor& indices, const at::Tensor& values);

}  // namespace fastcomm
