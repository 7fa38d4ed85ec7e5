// Blockwise absmax quantization (8/4/2-bit, nearest or stochastic rounding) and its inverse on CPU.
//
// Work is split into units of whole blocks that start on a byte boundary of the packed output, so threads
// never share an output byte. With error feedback each block is read from memory once: acc = x + source is
// written to the residual (and its absmax taken) in one loop, then, while the block sits in L1, one loop
// encodes it and overwrites the residual with acc - sent from the codes it just computed (no second pass
// over packed codes). Codes go through a tile of int32 codes that is then narrowed or packed.
//
// The hot loops are compiled twice (baseline and AVX2, see cpu_isa.h): the stochastic-rounding hash needs
// 32-bit vector multiplies (AVX2's vpmulld) to vectorize. Every float operation is element-wise, so both
// copies give the reference's bits.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "comm/cpu_isa.h"
#include "comm/kernels.h"

namespace fastcomm {
namespace {

// Smallest number of consecutive blocks (or chunks) whose packed bits fill whole bytes.
int64_t blocks_per_unit(int64_t block, int64_t bits) {
  int64_t g = 1;
  while ((g * block * bits) % 8 != 0) ++g;
  return g;
}

// max |x| over a block; NaN if the block holds an inf or NaN.
template <typename scalar_t>
inline float block_absmax(const scalar_t* x, int64_t len) {
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

// r = x + s rounded to the dtype (s may be r itself), and block_absmax of the result, in one loop.
template <typename scalar_t>
inline float accumulate_absmax(const scalar_t* x, const scalar_t* s, scalar_t* r, int64_t len) {
  float m = 0.0f;
  float poison = 0.0f;
#pragma omp simd reduction(max : m) reduction(+ : poison)
  for (int64_t j = 0; j < len; ++j) {
    const scalar_t acc = static_cast<scalar_t>(static_cast<float>(x[j]) + static_cast<float>(s[j]));
    r[j] = acc;
    const float v = static_cast<float>(acc);
    const float a = std::fabs(v);
    m = a > m ? a : m;
    poison += v * 0.0f;
  }
  return poison != poison ? std::numeric_limits<float>::quiet_NaN() : m;
}

// Elements one encode_codes call handles: a multiple of every codes-per-byte, and small enough that the
// loop counter and the hashed index are 32-bit lanes.
constexpr int64_t kTile = 1024;

// The codes of acc[0, len), len <= kTile, into o (int32: every lane of the loop is 32 bits wide, so the
// compiler runs the float math in full-width registers; uint8 codes would make it size the vectors by
// bytes). ``first`` is the global index of acc[0] (it seeds the hash). With FEEDBACK,
// r[j] = acc[j] - (code - qmax - 1) * scale in fp32, rounded once (r may be acc itself).
template <bool STOCHASTIC, bool FEEDBACK, typename scalar_t>
inline void encode_codes(const scalar_t* acc, int64_t first, int64_t len, float inv, float qmax, float scale,
                         uint32_t seed, int32_t* o, scalar_t* r) {
  const int offset = static_cast<int>(qmax) + 1;
  if (inv == 0.0f) {  // absmax zero, subnormal or not finite: every code is qmax + 1 (zero)
    std::fill(o, o + len, offset);
    if (FEEDBACK) {
      const float sent = 0.0f * scale;  // NaN for a non-finite block, as in the reference
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) r[j] = static_cast<scalar_t>(static_cast<float>(acc[j]) - sent);
    }
    return;
  }
  const float hi = 2.0f * qmax;
  const float nearest = qmax + 0.5f;
  const uint32_t count = static_cast<uint32_t>(len);
  float u[kTile];  // the uniform draws, in a loop of their own
  if (STOCHASTIC) {
    // Left to the compiler's cost model: vectorized where 32-bit multiplies exist (AVX2), scalar on
    // baseline x86-64, where emulating them costs more than it saves (an omp simd loop fusing the hash
    // with the encoding is slower in both builds).
    const uint32_t base = static_cast<uint32_t>(first);  // hash32 reads the index modulo 2^32
    for (uint32_t j = 0; j < count; ++j) u[j] = uniform_from_hash(fmix32(((base + j) * 0x9E3779B1u) ^ seed));
  }
#pragma omp simd
  for (uint32_t j = 0; j < count; ++j) {
    const float add = STOCHASTIC ? qmax + u[j] : nearest;
    const float v = static_cast<float>(acc[j]);
    float w = v * inv;
    w = w + add;
    w = std::min(std::max(w, 0.0f), hi);
    const int code = static_cast<int>(w) + 1;
    o[j] = code;
    if (FEEDBACK) r[j] = static_cast<scalar_t>(v - static_cast<float>(code - offset) * scale);
  }
}

// Packs m codes starting on a byte boundary; whole bytes are assigned, a trailing partial byte is OR-ed
// (the next block, which starts inside it, ORs its codes in too).
template <int BITS>
inline void pack_codes(const int32_t* codes, int64_t m, uint8_t* out) {
  constexpr int kPer = 8 / BITS;
  const int64_t full = m / kPer;
  if (BITS == 8) {
#pragma omp simd
    for (int64_t j = 0; j < full; ++j) out[j] = static_cast<uint8_t>(codes[j]);
    return;
  }
#pragma omp simd
  for (int64_t j = 0; j < full; ++j) {
    unsigned byte = 0;
    for (int t = 0; t < kPer; ++t) byte |= static_cast<unsigned>(codes[j * kPer + t]) << (t * BITS);
    out[j] = static_cast<uint8_t>(byte);
  }
  for (int64_t t = 0; t < m - full * kPer; ++t) out[full] |= static_cast<uint8_t>(codes[full * kPer + t] << (t * BITS));
}

template <bool STOCHASTIC, bool FEEDBACK, typename scalar_t>
inline void encode_block(const scalar_t* acc, int64_t first, int64_t len, float inv, float qmax, float scale,
                         uint32_t seed, int64_t bits, uint8_t* out, scalar_t* r) {
  const int64_t per_byte = 8 / bits;
  int32_t codes[kTile];
  for (int64_t off = 0; off < len; off += kTile) {
    const int64_t m = std::min(kTile, len - off);
    encode_codes<STOCHASTIC, FEEDBACK>(acc + off, first + off, m, inv, qmax, scale, seed, codes,
                                       FEEDBACK ? r + off : nullptr);
    if (first % per_byte == 0) {
      uint8_t* o = out + (first + off) / per_byte;
      if (bits == 8) {
        pack_codes<8>(codes, m, o);
      } else {
        bits == 4 ? pack_codes<4>(codes, m, o) : pack_codes<2>(codes, m, o);
      }
    } else {  // a block that starts inside a byte (block * bits not a multiple of 8): element by element
      for (int64_t j = 0; j < m; ++j) {
        const int64_t i = first + off + j;
        out[i / per_byte] |= static_cast<uint8_t>(codes[j] << ((i % per_byte) * bits));
      }
    }
  }
}

// What one range of blocks needs; residual and source are null without error feedback.
template <typename scalar_t>
struct QuantizeJob {
  const scalar_t* x;
  const scalar_t* source;  // residual_source, or the residual itself for the in-place form
  scalar_t* residual;      // overwritten with acc - sent
  uint8_t* codes;
  float* scales;
  int64_t n;
  int64_t block;
  int64_t bits;
  float qmax;
  uint32_t seed;
};

template <typename scalar_t, bool STOCHASTIC, bool FEEDBACK>
inline void quantize_range(const QuantizeJob<scalar_t>& job, int64_t blk_lo, int64_t blk_hi) {
  for (int64_t blk = blk_lo; blk < blk_hi; ++blk) {
    const int64_t first = blk * job.block;
    const int64_t len = std::min(job.block, job.n - first);
    const scalar_t* acc = job.x + first;
    scalar_t* r = FEEDBACK ? job.residual + first : nullptr;
    float absmax;
    if (FEEDBACK) {
      absmax = accumulate_absmax(acc, job.source + first, r, len);
      acc = r;
    } else {
      absmax = block_absmax(acc, len);
    }
    const float scale = absmax / job.qmax;
    job.scales[blk] = scale;
    float inv = (absmax > 0.0f && std::isfinite(absmax)) ? job.qmax / absmax : 0.0f;
    if (!std::isfinite(inv)) inv = 0.0f;  // a subnormal absmax: qmax / absmax overflows
    encode_block<STOCHASTIC, FEEDBACK>(acc, first, len, inv, job.qmax, scale, job.seed, job.bits, job.codes, r);
  }
}

template <typename scalar_t, bool STOCHASTIC, bool FEEDBACK>
FASTCOMM_AVX2 void quantize_range_avx2(const QuantizeJob<scalar_t>& job, int64_t blk_lo, int64_t blk_hi) {
  quantize_range<scalar_t, STOCHASTIC, FEEDBACK>(job, blk_lo, blk_hi);
}

template <typename scalar_t>
using QuantizeRangeFn = void (*)(const QuantizeJob<scalar_t>&, int64_t, int64_t);

template <typename scalar_t, bool STOCHASTIC, bool FEEDBACK>
QuantizeRangeFn<scalar_t> pick_quantize(bool avx2) {
  return avx2 ? &quantize_range_avx2<scalar_t, STOCHASTIC, FEEDBACK> : &quantize_range<scalar_t, STOCHASTIC, FEEDBACK>;
}

// Decodes m codes that start on a byte boundary: whole bytes with compile-time shifts, then a partial one.
// ACCUMULATE adds to out in fp32 and rounds once.
template <int BITS, bool ACCUMULATE, typename scalar_t>
inline void decode_run(const uint8_t* packed, float scale, int64_t m, scalar_t* out) {
  constexpr int kPer = 8 / BITS;
  constexpr int kMask = (1 << BITS) - 1;
  constexpr int kOffset = 1 << (BITS - 1);
  const int64_t full = m / kPer;
#pragma omp simd
  for (int64_t j = 0; j < full; ++j) {
    const int byte = packed[j];
    for (int t = 0; t < kPer; ++t) {
      const float value = static_cast<float>(((byte >> (t * BITS)) & kMask) - kOffset) * scale;
      scalar_t* o = out + j * kPer + t;
      *o = static_cast<scalar_t>(ACCUMULATE ? static_cast<float>(*o) + value : value);
    }
  }
  for (int64_t i = full * kPer; i < m; ++i) {
    const float value = static_cast<float>(((packed[full] >> ((i - full * kPer) * BITS)) & kMask) - kOffset) * scale;
    out[i] = static_cast<scalar_t>(ACCUMULATE ? static_cast<float>(out[i]) + value : value);
  }
}

// Blocks [blk_lo, blk_hi) of numel values into out.
template <typename scalar_t, int BITS, bool ACCUMULATE>
inline void dequantize_range(const uint8_t* codes, const float* scales, int64_t numel, int64_t block,
                             scalar_t* out, int64_t blk_lo, int64_t blk_hi) {
  constexpr int kPer = 8 / BITS;
  constexpr int kMask = (1 << BITS) - 1;
  constexpr int kOffset = 1 << (BITS - 1);
  for (int64_t blk = blk_lo; blk < blk_hi; ++blk) {
    const float scale = scales[blk];
    const int64_t first = blk * block;
    const int64_t last = std::min(numel, first + block);
    if (first % kPer == 0) {
      decode_run<BITS, ACCUMULATE>(codes + first / kPer, scale, last - first, out + first);
    } else {  // a block that starts inside a byte
      for (int64_t i = first; i < last; ++i) {
        const int code = (codes[i / kPer] >> ((i % kPer) * BITS)) & kMask;
        const float value = static_cast<float>(code - kOffset) * scale;
        out[i] = static_cast<scalar_t>(ACCUMULATE ? static_cast<float>(out[i]) + value : value);
      }
    }
  }
}

template <typename scalar_t, int BITS, bool ACCUMULATE>
FASTCOMM_AVX2 void dequantize_range_avx2(const uint8_t* codes, const float* scales, int64_t numel, int64_t block,
                                         scalar_t* out, int64_t blk_lo, int64_t blk_hi) {
  dequantize_range<scalar_t, BITS, ACCUMULATE>(codes, scales, numel, block, out, blk_lo, blk_hi);
}

template <typename scalar_t>
using DequantizeRangeFn = void (*)(const uint8_t*, const float*, int64_t, int64_t, scalar_t*, int64_t, int64_t);

template <typename scalar_t, bool ACCUMULATE>
DequantizeRangeFn<scalar_t> pick_dequantize(int64_t bits, bool avx2) {
  if (bits == 8) {
    return avx2 ? &dequantize_range_avx2<scalar_t, 8, ACCUMULATE> : &dequantize_range<scalar_t, 8, ACCUMULATE>;
  }
  if (bits == 4) {
    return avx2 ? &dequantize_range_avx2<scalar_t, 4, ACCUMULATE> : &dequantize_range<scalar_t, 4, ACCUMULATE>;
  }
  return avx2 ? &dequantize_range_avx2<scalar_t, 2, ACCUMULATE> : &dequantize_range<scalar_t, 2, ACCUMULATE>;
}

// out (contiguous, numel = out.numel()) = or += the first numel values of (codes, scales).
void dequantize_into(const at::Tensor& out, const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                     int64_t block, bool accumulate, const char* op) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4 || bits == 2, op, ": bits must be 8, 4 or 2, got ", bits);
  TORCH_CHECK_VALUE(block > 0, op, ": block must be positive, got ", block);
  TORCH_CHECK_VALUE(out.is_contiguous(), op, ": out must be contiguous");
  TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte, op, ": codes must be uint8, got ", codes.scalar_type());
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat, op, ": scales must be float32, got ", scales.scalar_type());
  const int64_t numel = out.numel();
  const int64_t nbytes = ceil_div(numel * bits, 8);
  const int64_t nblocks = ceil_div(numel, block);
  const at::Tensor cc = payload_prefix(op, "codes", codes, nbytes, "bytes");
  const at::Tensor sc = payload_prefix(op, "scales", scales, nblocks, "elements");
  if (numel == 0) return;
  const bool avx2 = use_avx2();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "dequantize_blockwise_cpu", [&] {
    const auto fn = accumulate ? pick_dequantize<scalar_t, true>(bits, avx2) : pick_dequantize<scalar_t, false>(bits, avx2);
    const uint8_t* cp = cc.const_data_ptr<uint8_t>();
    const float* sp = sc.const_data_ptr<float>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    at::parallel_for(0, nblocks, std::max<int64_t>(1, 65536 / block), [&](int64_t lo, int64_t hi) {
      fn(cp, sp, numel, block, op_, lo, hi);
    });
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cpu(const at::Tensor& x, int64_t bits, int64_t block,
                                                          bool stochastic, int64_t seed,
                                                          const std::optional<at::Tensor>& residual,
                                                          const std::optional<at::Tensor>& residual_source) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4 || bits == 2, "quantize_blockwise: bits must be 8, 4 or 2, got ", bits);
  TORCH_CHECK_VALUE(block > 0, "quantize_blockwise: block must be positive, got ", block);
  const at::Tensor flat = x.contiguous().view(-1);
  const int64_t n = flat.numel();
  const int64_t nblocks = ceil_div(n, block);
  const ResidualBuffers buffers("quantize_blockwise", x, residual, residual_source);
  at::Tensor codes = bits == 8 ? x.new_empty({n}, at::kByte)
                               : x.new_zeros({ceil_div(n * bits, 8)}, at::kByte);
  at::Tensor scales = x.new_empty({nblocks}, at::kFloat);
  const int64_t unit = blocks_per_unit(block, bits);
  const int64_t units = ceil_div(nblocks, unit);
  const int64_t grain = std::max<int64_t>(1, 65536 / (unit * block));
  const bool avx2 = use_avx2();
  const bool feedback = buffers.feedback();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize_blockwise_cpu", [&] {
    QuantizeJob<scalar_t> job;
    job.x = flat.const_data_ptr<scalar_t>();
    job.source = buffers.source_data<scalar_t>();
    job.residual = buffers.residual_data<scalar_t>();
    job.codes = codes.data_ptr<uint8_t>();
    job.scales = scales.data_ptr<float>();
    job.n = n;
    job.block = block;
    job.bits = bits;
    job.qmax = static_cast<float>((1 << (bits - 1)) - 1);
    job.seed = seed32(seed);
    QuantizeRangeFn<scalar_t> fn;
    if (stochastic) {
      fn = feedback ? pick_quantize<scalar_t, true, true>(avx2) : pick_quantize<scalar_t, true, false>(avx2);
    } else {
      fn = feedback ? pick_quantize<scalar_t, false, true>(avx2) : pick_quantize<scalar_t, false, false>(avx2);
    }
    at::parallel_for(0, units, grain, [&](int64_t lo, int64_t hi) {
      fn(job, lo * unit, std::min(nblocks, hi * unit));
    });
  });
  buffers.finish(residual);
  return {codes, scales};
}

at::Tensor dequantize_blockwise_cpu(const at::Tensor& codes, const at::Tensor& scales, int64_t numel, int64_t bits,
                                    int64_t block, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4 || bits == 2, "dequantize_blockwise: bits must be 8, 4 or 2, got ", bits);
  TORCH_CHECK_VALUE(block > 0, "dequantize_blockwise: block must be positive, got ", block);
  TORCH_CHECK_VALUE(codes.numel() == ceil_div(numel * bits, 8), "dequantize_blockwise: codes has ", codes.numel(),
                    " bytes, expected ", ceil_div(numel * bits, 8));
  TORCH_CHECK_VALUE(scales.numel() == ceil_div(numel, block), "dequantize_blockwise: scales has ", scales.numel(),
                    " elements, expected ", ceil_div(numel, block));
  at::Tensor out = codes.new_empty({numel}, dtype);
  dequantize_into(out, codes, scales, bits, block, /*accumulate=*/false, "dequantize_blockwise");
  return out;
}

void dequantize_blockwise_into_cpu(const at::Tensor& out, const at::Tensor& codes, const at::Tensor& scales,
                                   int64_t bits, int64_t block, bool accumulate) {
  dequantize_into(out, codes, scales, bits, block, accumulate, "dequantize_blockwise_into");
}

}  // namespace fastcomm
