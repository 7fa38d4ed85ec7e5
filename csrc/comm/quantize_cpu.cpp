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

// One code per output byte for x[0, len); ``first`` is the global index of x[0] (it seeds the hash).
template <typename scalar_t>
void encode_codes(const scalar_t* x, int64_t first, int64_t len, float inv, float qmax, bool stochastic,
                  uint32_t seed, uint8_t* o) {
  const float hi = 2.0f * qmax;
  if (inv == 0.0f) {
    std::memset(o, static_cast<int>(qmax) + 1, len);
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
}

// Packs m codes starting on a byte boundary; whole bytes are assigned, a trailing partial byte is OR-ed
// (the next block, which starts inside it, ORs its codes in too).
template <int BITS>
void pack_codes(const uint8_t* codes, int64_t m, uint8_t* out) {
  constexpr int kPer = 8 / BITS;
  const int64_t full = m / kPer;
  for (int64_t j = 0; j < full; ++j) {
    unsigned byte = 0;
    for (int t = 0; t < kPer; ++t) byte |= static_cast<unsigned>(codes[j * kPer + t]) << (t * BITS);
    out[j] = static_cast<uint8_t>(byte);
  }
  for (int64_t t = 0; t < m - full * kPer; ++t) out[full] |= static_cast<uint8_t>(codes[full * kPer + t] << (t * BITS));
}

template <typename scalar_t>
void encode_block(const scalar_t* x, int64_t first, int64_t len, float inv, float qmax, bool stochastic,
                  uint32_t seed, int64_t bits, uint8_t* out) {
  if (bits == 8) {
    encode_codes(x, first, len, inv, qmax, stochastic, seed, out + first);
    return;
  }
  const int64_t per_byte = 8 / bits;
  constexpr int64_t kTile = 1024;  // a multiple of every per_byte; stays in L1
  uint8_t codes[kTile];
  if (first % per_byte == 0) {
    for (int64_t off = 0; off < len; off += kTile) {
      const int64_t m = std::min(kTile, len - off);
      encode_codes(x + off, first + off, m, inv, qmax, stochastic, seed, codes);
      uint8_t* o = out + (first + off) / per_byte;
      bits == 4 ? pack_codes<4>(codes, m, o) : pack_codes<2>(codes, m, o);
    }
    return;
  }
  // A block that starts inside a byte (block * bits not a multiple of 8): element by element.
  for (int64_t off = 0; off < len; off += kTile) {
    const int64_t m = std::min(kTile, len - off);
    encode_codes(x + off, first + off, m, inv, qmax, stochastic, seed, codes);
    for (int64_t j = 0; j < m; ++j) {
      const int64_t i = first + off + j;
      out[i / per_byte] |= static_cast<uint8_t>(codes[j] << ((i % per_byte) * bits));
    }
  }
}

// Decodes m codes that start on a byte boundary.
template <int BITS, typename scalar_t>
void decode_packed(const uint8_t* packed, float scale, int64_t m, scalar_t* out) {
  constexpr int kPer = 8 / BITS;
  constexpr int kMask = (1 << BITS) - 1;
  constexpr int kOffset = 1 << (BITS - 1);
  for (int64_t i = 0; i < m; ++i) {
    const int code = (packed[i / kPer] >> ((i % kPer) * BITS)) & kMask;
    out[i] = static_cast<scalar_t>(static_cast<float>(code - kOffset) * scale);
  }
}

template <typename scalar_t>
void decode_block8(const uint8_t* codes, float scale, int offset, int64_t len, scalar_t* out) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    out[i] = static_cast<scalar_t>(static_cast<float>(static_cast<int>(codes[i]) - offset) * scale);
  }
}

// Error feedback after encoding: residual (holding acc) becomes acc - dequantized, in fp32, rounded once.
template <typename scalar_t>
void subtract_dequantized(const uint8_t* codes, int64_t first, int64_t len, int64_t bits, float scale,
                          scalar_t* acc) {
  const int offset = 1 << (bits - 1);
  if (bits == 8) {
    const uint8_t* c = codes + first;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
      const float sent = static_cast<float>(static_cast<int>(c[j]) - offset) * scale;
      acc[j] = static_cast<scalar_t>(static_cast<float>(acc[j]) - sent);
    }
    return;
  }
  const int64_t per_byte = 8 / bits;
  const int mask = (1 << bits) - 1;
  for (int64_t j = 0; j < len; ++j) {
    const int64_t i = first + j;
    const int code = (codes[i / per_byte] >> ((i % per_byte) * bits)) & mask;
    const float sent = static_cast<float>(code - offset) * scale;
    acc[j] = static_cast<scalar_t>(static_cast<float>(acc[j]) - sent);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cpu(const at::Tensor& x, int64_t bits, int64_t block,
                                                          bool stochastic, int64_t seed,
                                                          const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "quantize_blockwise: bits must be 8, 4 or 2, got ", bits);
  TORCH_CHECK(block > 0, "quantize_blockwise: block must be positive, got ", block);
  const at::Tensor flat = x.contiguous().view(-1);
  const int64_t n = flat.numel();
  const int64_t nblocks = ceil_div(n, block);
  at::Tensor work;  // the residual buffer the kernel updates (a contiguous copy when the caller's is not)
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "quantize_blockwise: residual must match x in shape and dtype");
    work = residual->is_contiguous() ? *residual : residual->contiguous();
  }
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
    scalar_t* rp = work.defined() ? work.data_ptr<scalar_t>() : nullptr;
    uint8_t* cp = codes.data_ptr<uint8_t>();
    float* sp = scales.data_ptr<float>();
    at::parallel_for(0, units, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t blk = lo * unit; blk < std::min(nblocks, hi * unit); ++blk) {
        const int64_t first = blk * block;
        const int64_t len = std::min(block, n - first);
        const scalar_t* acc = xp + first;
        if (rp != nullptr) {
          scalar_t* r = rp + first;
          for (int64_t j = 0; j < len; ++j) {
            r[j] = static_cast<scalar_t>(static_cast<float>(acc[j]) + static_cast<float>(r[j]));
          }
          acc = r;
        }
        const float absmax = block_absmax(acc, len);
        const float scale = absmax / qmax;
        sp[blk] = scale;
        float inv = (absmax > 0.0f && std::isfinite(absmax)) ? qmax / absmax : 0.0f;
        if (!std::isfinite(inv)) inv = 0.0f;  // a subnormal absmax: qmax / absmax overflows
        encode_block(acc, first, len, inv, qmax, stochastic, s32, bits, cp);
        if (rp != nullptr) subtract_dequantized(cp, first, len, bits, scale, rp + first);
      }
    });
  });
  if (work.defined() && !work.is_same(*residual)) residual->copy_(work);
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
        } else if (first % per_byte == 0) {
          bits == 4 ? decode_packed<4>(cp + first / per_byte, scale, last - first, op + first)
                    : decode_packed<2>(cp + first / per_byte, scale, last - first, op + first);
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
