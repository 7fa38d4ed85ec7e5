// Declarations of the CPU kernels of fastcomm's ops and the small helpers they share.
// The schemas live in fastcomm/ops.py; the specification every kernel reproduces is fastcomm/reference.py.
#pragma once

// The tensor type alone, not <ATen/ATen.h>: the kernels allocate through its methods (x.new_empty,
// x.new_zeros, which call at::empty / at::zeros), as <ATen/ops/empty.h> brings in ATen's whole Context, about
// 5 s of compile per file (the native build is part of `make test`'s install).
#include <ATen/core/Tensor.h>

#include <atomic>
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

// How many iterations ahead a loop of scattered reads (sampled positions, sparse indices) prefetches.
constexpr int64_t kPrefetchAhead = 32;

// Must equal reference.approx_sample_size.
inline int64_t approx_sample_size(int64_t n, int64_t k) {
  if (k <= 0) return 0;
  const int64_t wanted = std::max<int64_t>(65536, ceil_div(1000 * n, k));
  return std::min(n, wanted);
}

// The first `needed` elements of a payload (codes, signs or scales), contiguous: a longer, zero-padded payload
// is not copied whole. A shorter one is refused, naming the op, the argument and the sizes.
inline at::Tensor payload_prefix(const char* op, const char* name, const at::Tensor& payload, int64_t needed,
                                 const char* unit) {
  TORCH_CHECK_VALUE(payload.numel() >= needed, op, ": ", name, " has ", payload.numel(), " ", unit,
                    ", needs at least ", needed);
  return payload.reshape(-1).slice(0, 0, needed).contiguous();
}

// The error-feedback buffers of a compressing op: `work` is what the kernel writes acc - sent into (the
// caller's residual, or a contiguous stand-in copied back by finish()), `source` what acc = x + source reads
// (residual_source, or the residual itself for the in-place form). Undefined without a residual.
struct ResidualBuffers {
  at::Tensor work;
  at::Tensor source;

  ResidualBuffers(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                  const std::optional<at::Tensor>& residual_source) {
    if (!residual.has_value()) {
      TORCH_CHECK_VALUE(!residual_source.has_value(), op,
                        ": residual_source needs residual (the buffer acc - sent is written to)");
      return;
    }
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), op,
                      ": residual must match x in shape and dtype");
    if (residual_source.has_value() && !residual_source->is_same(*residual)) {
      TORCH_CHECK_VALUE(residual_source->sizes() == x.sizes() && residual_source->scalar_type() == x.scalar_type(),
                        op, ": residual_source must match x in shape and dtype");
      work = residual->is_contiguous() ? *residual : x.new_empty(x.sizes());
      source = residual_source->contiguous();
    } else {
      work = residual->is_contiguous() ? *residual : residual->contiguous();
      source = work;
    }
  }

  bool feedback() const { return work.defined(); }

  // The kernel's pointers: what it reads, what it writes; null without error feedback.
  template <typename scalar_t>
  const scalar_t* source_data() const {
    return feedback() ? source.const_data_ptr<scalar_t>() : nullptr;
  }
  template <typename scalar_t>
  scalar_t* residual_data() const {
    return feedback() ? work.data_ptr<scalar_t>() : nullptr;
  }

  // Copy a stand-in back into the caller's (non-contiguous) residual.
  void finish(const std::optional<at::Tensor>& residual) const {
    if (work.defined() && !work.is_same(*residual)) residual->copy_(work);
  }
};

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
void sparse_mean_cpu(const at::Tensor& out, const at::Tensor& indices, const at::Tensor& values, int64_t world_size,
                     const std::optional<at::Tensor>& clear);
// Cleared by tests and benchmarks to store every row through the cache (fastcomm._C._set_streaming).
std::atomic<bool>& streaming_allowed();
// Whether a kernel writing `bytes` that nothing reads back before they leave the caches stores them
// non-temporally: streaming_allowed(), and more bytes than the last-level cache could keep.
bool worth_streaming(int64_t bytes);
void powersgd_project_cpu(const at::Tensor& p, const at::Tensor& x, const at::Tensor& q_t,
                          const std::optional<at::Tensor>& gradient, const std::optional<at::Tensor>& residual);
void powersgd_back_project_cpu(const at::Tensor& q_t, const at::Tensor& p, const at::Tensor& x);
void powersgd_expand_cpu(const at::Tensor& mean, const at::Tensor& p, const at::Tensor& q_t,
                         const std::optional<at::Tensor>& residual);

}  // namespace fastcomm
