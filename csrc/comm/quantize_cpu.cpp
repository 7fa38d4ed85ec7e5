// Blockwise absmax quantization (8/4/2-bit, nearest or stochastic rounding) and its inverse on CPU.
//
// Work is split into units of whole blocks that start on a byte boundary of the packed output, so threads
// never share an output byte. Each block is read twice while it sits in L1: once for absmax, once to encode.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "comm/kernels.h"

namespace fastcomm {
namespace {

// Smallest number of consecutive blocks (or chunks) whose packed bits fill whole bytes.
int64_t blocks_per_unit(int64_t block, int64_t bits) {
  int64_t g = 1;
  while ((g * block * bits) % 8 != 0) ++g;
  return g;
}

template <typename scalar_t>
float block_absmax(const scalar_t* x, int64_t len) {
  float m = 0.0f;
  float poison = 0.0f;  // stays 0 for finite data, NaN once an inf or NaN is seen
#pragma omp simd reduction(max : m) reduction(+ : poison)
  for (int64_t j = 0; j < len; ++j) {
    const float v = static_cast<float>(x[j]);
    const float a = std::fabs(v);
    m = a > m ? a : m;
    poison += v * 0.0f;
  }
  return poison != poison ? std::numeric_limits<float>::quiet_NaN() : m;
}

template <typename scalar_t>
void encode_block(const scalar_t* x, int64_t first, int64_t len, float inv, float qmax, bool stochastic,
                  uint32_t seed, int64_t bits, uint8_t* out) {
  const int code_zero = static_cast<int>(qmax) + 1;
  const float hi = 2.0f * qmax;
  if (bits == 8) {
    uint8_t* o = out + first;
    if (inv == 0.0f) {
      for (int64_t j = 0; j < len; ++j) o[j] = static_cast<uint8_t>(code_zero);
    } else if (!stochastic) {
      const float add = qmax + 0.5f;
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) {
        float w = static_cast<float>(x[j]) * inv;
        w = w + add;
        w = std::min(std::max(w, 0.0f), hi);
        o[j] = static_cast<uint8_t>(static_cast<int>(w) + 1);
      }
    } else {
      for (int64_t j = 0; j < len; ++j) {
        const float add = qmax + uniform_from_hash(hash32(static_cast<uint64_t>(first + j), seed));
        float w = static_cast<float>(x[j]) * inv;
        w = w + add;
        w = std::min(std::max(w, 0.0f), hi);
        o[j] = static_cast<uint8_t>(static_cast<int>(w) + 1);
      }
    }
    return;
  }
  const int64_t per_byte = 8 / bits;
  for (int64_t j = 0; j < len; ++j) {
    const int64_t i = first + j;
    int code = code_zero;
    if (inv != 0.0f) {
      const float u = stochastic ? uniform_from_hash(hash32(static_cast<uint64_t>(i), seed)) : 0.5f;
      float w = static_cast<float>(x[j]) * inv;
      w = w + (qmax + u);
      w = std::min(std::max(w, 0.0f), hi);
      code = static_cast<int>(w) + 1;
    }
    out[i / per_byte] |= static_cast<uint8_t>(code << ((i % per_byte) * bits));
  }
}

template <typename scalar_t>
void decode_block8(const uint8_t* codes, float scale, int offset, int64_t len, scalar_t* out) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    out[i] = static_cast<scalar_t>(static_cast<float>(static_cast<int>(codes[i]) - offset) * scale);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cpu(const at::Tensor& x, int64_t bits, int64_t block,
                                                          bool stochastic, int64_t seed) {
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "quantize_blockwise: bits must be 8, 4 or 2, got ", bits);
  TORCH_CHECK(block > 0, "quantize_blockwise: block must be positive, got ", block);
  const at::Tensor flat = x.contiguous().view(-1);
  const int64_t n = flat.numel();
  const int64_t nblocks = ceil_div(n, block);
  at::Tensor codes = bits == 8 ? at::empty({n}, x.options().dtype(at::kByte))
                               : at::zeros({ceil_div(n * bits, 8)}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({nblocks}, x.options().dtype(at::kFloat));
  const float qmax = static_cast<float>((1 << (bits - 1)) - 1);
  const uint32_t s32 = seed32(seed);
  const int64_t unit = blocks_per_unit(block, bits);
  const int64_t units = ceil_div(nblocks, unit);
  const int64_t grain = std::max<int64_t>(1, 65536 / (unit * block));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize_blockwise_cpu", [&] {
    const scalar_t* xp = flat.const_data_ptr<scalar_t>();
    uint8_t* cp = codes.data_ptr<uint8_t>();
    float* sp = scales.data_ptr<float>();
    at::parallel_for(0, units, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t blk = lo * unit; blk < std::min(nblocks, hi * unit); ++blk) {
        const int64_t first = blk * block;
        const int64_t len = std::min(block, n - first);
        const float absmax = block_absmax(xp + first, len);
        sp[blk] = absmax / qmax;
        const float inv = (absmax > 0.0f && std::isfinite(absmax)) ? qmax / absmax : 0.0f;
        encode_block(xp + first, first, len, inv, qmax, stochastic, s32, bits, cp);
      }
    });
  });
  return {codes, scales};
}

at::Tensor dequantize_blockwise_cpu(const at::Tensor& codes, const at::Tensor& scales, int64_t numel, int64_t bits,
                                    int64_t block, at::ScalarType dtype) {
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "dequantize_blockwise: bits must be 8, 4 or 2, got ", bits);
  TORCH_CHECK(codes.numel() == ceil_div(numel * bits, 8), "dequantize_blockwise: codes has ", codes.numel(),
              " bytes, expected ", ceil_div(numel * bits, 8));
  TORCH_CHECK(scales.numel() == ceil_div(numel, block), "dequantize_blockwise: scales has ", scales.numel(),
              " elements, expected ", ceil_div(numel, block));
  const at::Tensor cc = codes.contiguous();
  const at::Tensor sc = scales.contiguous();
  at::Tensor out = at::empty({numel}, codes.options().dtype(dtype));
  const int64_t nblocks = ceil_div(numel, block);
  const int offset = (1 << (bits - 1));
  const int64_t per_byte = 8 / bits;
  const int mask = (1 << bits) - 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "dequantize_blockwise_cpu", [&] {
    const uint8_t* cp = cc.const_data_ptr<uint8_t>();
    const float* sp = sc.const_data_ptr<float>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, nblocks, std::max<int64_t>(1, 65536 / block), [&](int64_t lo, int64_t hi) {
      for (int64_t blk = lo; blk < hi; ++blk) {
        const float scale = sp[blk];
        const int64_t first = blk * block;
        const int64_t last = std::min(numel, first + block);
        if (bits == 8) {
          decode_block8(cp + first, scale, offset, last - first, op + first);
        } else {
          for (int64_t i = first; i < last; ++i) {
            const int code = (cp[i / per_byte] >> ((i % per_byte) * bits)) & mask;
            op[i] = static_cast<scalar_t>(static_cast<float>(code - offset) * scale);
          }
        }
      }
    });
  });
  return out;
}

}  // namespace fastcomm
