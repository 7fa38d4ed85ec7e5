// 1-bit sign compression with per-chunk mean-magnitude scales and error feedback, and its inverse, on CPU.
// Work is split into whole chunks that start on a byte boundary of the packed bits (no shared bytes).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "comm/kernels.h"

namespace fastcomm {
namespace {

template <typename scalar_t>
double sum_abs(const scalar_t* acc, int64_t len) {
  double total = 0.0;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < len; ++i) total += std::fabs(static_cast<double>(static_cast<float>(acc[i])));
  return total;
}

// Whole bytes: bit t of byte j is acc[8j + t] >= 0 (false for NaN, true for -0.0, as in the reference).
template <typename scalar_t>
void pack_signs_bytes(const scalar_t* acc, int64_t nbytes, uint8_t* out) {
  for (int64_t j = 0; j < nbytes; ++j) {
    const scalar_t* a = acc + 8 * j;
    unsigned byte = 0;
    for (int t = 0; t < 8; ++t) byte |= static_cast<unsigned>(static_cast<float>(a[t]) >= 0.0f) << t;
    out[j] = static_cast<uint8_t>(byte);
  }
}

// residual = acc - (+scale or -scale), the acc being the residual buffer itself.
template <typename scalar_t>
void subtract_signs(scalar_t* acc, float scale, int64_t len) {
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &scale, sizeof(scale_bits));
  for (int64_t i = 0; i < len; ++i) {
    const float a = static_cast<float>(acc[i]);
    // Branch-free: signs are random, so a branch would mispredict half the time.
    const uint32_t sent_bits = scale_bits ^ (static_cast<uint32_t>(!(a >= 0.0f)) << 31);
    float sent;
    std::memcpy(&sent, &sent_bits, sizeof(sent));
    acc[i] = static_cast<scalar_t>(a - sent);
  }
}

#if defined(__SSE2__)
// fp32 fast paths: cmpge (false for NaN, true for -0.0, as above) and movemask give 4 bits at a time.
template <>
void pack_signs_bytes<float>(const float* acc, int64_t nbytes, uint8_t* out) {
  const __m128 zero = _mm_setzero_ps();
  for (int64_t j = 0; j < nbytes; ++j) {
    const int low = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(acc + 8 * j), zero));
    const int high = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(acc + 8 * j + 4), zero));
    out[j] = static_cast<uint8_t>(low | (high << 4));
  }
}
#endif

template <typename scalar_t>
void unpack_signs_bytes(const uint8_t* bits, int64_t nbytes, scalar_t plus, scalar_t minus, scalar_t* out) {
  for (int64_t j = 0; j < nbytes; ++j) {
    const unsigned byte = bits[j];
    scalar_t* o = out + 8 * j;
    for (int t = 0; t < 8; ++t) o[t] = ((byte >> t) & 1u) ? plus : minus;
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sign_compress_cpu(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                     int64_t chunk) {
  TORCH_CHECK(chunk > 0, "sign_compress: chunk must be positive, got ", chunk);
  const at::Tensor flat = x.contiguous().view(-1);
  const int64_t n = flat.numel();
  const int64_t nchunks = ceil_div(n, chunk);
  at::Tensor work;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "sign_compress: residual must match x in shape and dtype");
    work = residual->is_contiguous() ? *residual : residual->contiguous();
  }
  at::Tensor packed = at::zeros({ceil_div(n, 8)}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({nchunks}, x.options().dtype(at::kFloat));
  int64_t unit = 1;
  while ((unit * chunk) % 8 != 0) ++unit;
  const int64_t units = ceil_div(nchunks, unit);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sign_compress_cpu", [&] {
    const scalar_t* xp = flat.const_data_ptr<scalar_t>();
    scalar_t* rp = work.defined() ? work.data_ptr<scalar_t>() : nullptr;
    uint8_t* bp = packed.data_ptr<uint8_t>();
    float* sp = scales.data_ptr<float>();
    at::parallel_for(0, units, std::max<int64_t>(1, 65536 / (unit * chunk)), [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo * unit; c < std::min(nchunks, hi * unit); ++c) {
        const int64_t first = c * chunk;
        const int64_t last = std::min(n, first + chunk);
        const scalar_t* acc = xp;
        if (rp != nullptr) {
          for (int64_t i = first; i < last; ++i) {
            rp[i] = static_cast<scalar_t>(static_cast<float>(xp[i]) + static_cast<float>(rp[i]));
          }
          acc = rp;
        }
        const double total = sum_abs(acc + first, last - first);
        const float scale = static_cast<float>(total / static_cast<double>(last - first));
        sp[c] = scale;
        if (first % 8 == 0 && (last - first) % 8 == 0) {
          pack_signs_bytes(acc + first, (last - first) / 8, bp + first / 8);
        } else {
          for (int64_t i = first; i < last; ++i) {
            bp[i >> 3] |= static_cast<uint8_t>(static_cast<float>(acc[i]) >= 0.0f) << (i & 7);
          }
        }
        if (rp != nullptr) subtract_signs(rp + first, scale, last - first);
      }
    });
  });
  if (work.defined() && !work.is_same(*residual)) residual->copy_(work);
  return {packed, scales};
}

at::Tensor sign_decompress_cpu(const at::Tensor& packed, const at::Tensor& scales, int64_t numel, int64_t chunk,
                               at::ScalarType dtype) {
  TORCH_CHECK(chunk > 0, "sign_decompress: chunk must be positive, got ", chunk);
  TORCH_CHECK(packed.numel() == ceil_div(numel, 8), "sign_decompress: packed has ", packed.numel(),
              " bytes, expected ", ceil_div(numel, 8));
  TORCH_CHECK(scales.numel() == ceil_div(numel, chunk), "sign_decompress: scales has ", scales.numel(),
              " elements, expected ", ceil_div(numel, chunk));
  const at::Tensor pc = packed.contiguous();
  const at::Tensor sc = scales.contiguous();
  at::Tensor out = at::empty({numel}, packed.options().dtype(dtype));
  const int64_t nchunks = ceil_div(numel, chunk);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "sign_decompress_cpu", [&] {
    const uint8_t* bp = pc.const_data_ptr<uint8_t>();
    const float* sp = sc.const_data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, nchunks, std::max<int64_t>(1, 65536 / chunk), [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        const scalar_t plus = static_cast<scalar_t>(sp[c]);
        const scalar_t minus = static_cast<scalar_t>(-sp[c]);
        const int64_t first = c * chunk;
        const int64_t last = std::min(numel, first + chunk);
        if (first % 8 == 0 && (last - first) % 8 == 0) {
          unpack_signs_bytes(bp + first / 8, (last - first) / 8, plus, minus, op + first);
        } else {
          for (int64_t i = first; i < last; ++i) op[i] = ((bp[i >> 3] >> (i & 7)) & 1) ? plus : minus;
        }
      }
    });
  });
  return out;
}

}  // namespace fastcomm
