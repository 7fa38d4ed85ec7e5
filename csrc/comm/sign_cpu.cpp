// 1-bit sign compression with per-chunk mean-magnitude scales and error feedback, and its inverse, on CPU.
// Work is split into whole chunks that start on a byte boundary of the packed bits (no shared bytes). With
// error feedback a chunk is read from memory once (acc = x + source written to the residual); the scale, the
// sign bits and the residual update then read it from cache.
//
// The loops are compiled twice (baseline and AVX2, see cpu_isa.h). The fp64 sum behind each scale is written
// in an explicit order (LaneSums, with GCC/Clang vector extensions, as the build flags already assume), so
// both copies, and any compiler, give the same scales.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "comm/cpu_isa.h"
#include "comm/kernels.h"

namespace fastcomm {
namespace {

// Partial sums (lanes) of a chunk's fp64 sum of |acc|: the order in which the compiler vectorized the
// earlier `omp simd reduction` loop for each dtype (so scales keep their bits), now written out so it no
// longer depends on the compiler or the instruction set.
template <typename scalar_t>
constexpr int kSumLanes = 1;  // fp16: one sequential sum
template <>
constexpr int kSumLanes<float> = 4;
template <>
constexpr int kSumLanes<c10::BFloat16> = 8;

// Chunks whose sums are interleaved: enough independent chains to hide the fp64 add latency that bounds a
// single chunk's sum (about 16 in flight).
template <typename scalar_t>
constexpr int kSumGroup = std::max(1, 16 / kSumLanes<scalar_t>);

// The fp64 sums of |acc| of G chunks, `stride` apart, each in the same fixed order: lane k (k < L) adds the
// elements i = k (mod L) below len - len % L in increasing i, the remaining ones are added to lane 0, and
// total = (((0 + lane 0) + lane 1) + ...). Interleaving G chunks changes no chunk's order. Lanes are held
// in pairs (GCC/Clang vector extensions: lane-wise IEEE operations on any instruction set, so the compiler
// cannot reorder the sum, and no wider than SSE2 registers, which keeps the baseline copy free of spills).
template <int G, typename scalar_t>
struct LaneSums {
  static constexpr int L = kSumLanes<scalar_t>;
  static constexpr int P = (L + 1) / 2;  // lane pairs (a single lane, L = 1, uses the low half)
  typedef float floats2 __attribute__((vector_size(8)));
  typedef double doubles2 __attribute__((vector_size(16)));
  doubles2 lane[G][P];

  LaneSums() {
    for (int g = 0; g < G; ++g) {
      for (int p = 0; p < P; ++p) lane[g][p] = doubles2{};
    }
  }

  static int64_t main_part(int64_t len) { return len - len % L; }

  // Elements [from, to) of every chunk, from and to multiples of L and at most main_part(len); called for
  // consecutive ranges in increasing order.
  void add(const scalar_t* acc, int64_t stride, int64_t from, int64_t to) {
    for (int64_t i = from; i < to; i += L) {
      for (int g = 0; g < G; ++g) {
        const scalar_t* a = acc + g * stride + i;
        for (int p = 0; p < P; ++p) {
          const floats2 two = {std::fabs(static_cast<float>(a[2 * p])),
                               L == 1 ? 0.0f : std::fabs(static_cast<float>(a[(2 * p + 1) % L]))};
          lane[g][p] += __builtin_convertvector(two, doubles2);
        }
      }
    }
  }

  // Adds the elements [main_part(len), len) and folds the lanes.
  void finish(const scalar_t* acc, int64_t stride, int64_t len, double* totals) const {
    for (int g = 0; g < G; ++g) {
      double total = lane[g][0][0];
      for (int64_t i = main_part(len); i < len; ++i) {
        total += std::fabs(static_cast<double>(static_cast<float>(acc[g * stride + i])));
      }
      total = 0.0 + total;
      for (int k = 1; k < L; ++k) total += lane[g][k / 2][k % 2];
      totals[g] = total;
    }
  }
};

// Whole bytes: bit t of byte j is acc[8j + t] >= 0 (false for NaN, true for -0.0, as in the reference).
template <typename scalar_t>
inline void pack_signs_bytes(const scalar_t* acc, int64_t nbytes, uint8_t* out) {
  for (int64_t j = 0; j < nbytes; ++j) {
    const scalar_t* a = acc + 8 * j;
    unsigned byte = 0;
    for (int t = 0; t < 8; ++t) byte |= static_cast<unsigned>(static_cast<float>(a[t]) >= 0.0f) << t;
    out[j] = static_cast<uint8_t>(byte);
  }
}

#if defined(__SSE2__)
// fp32 fast path: cmpge (false for NaN, true for -0.0, as above) and movemask give 4 bits at a time.
template <>
inline void pack_signs_bytes<float>(const float* acc, int64_t nbytes, uint8_t* out) {
  const __m128 zero = _mm_setzero_ps();
  for (int64_t j = 0; j < nbytes; ++j) {
    const int low = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(acc + 8 * j), zero));
    const int high = _mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(acc + 8 * j + 4), zero));
    out[j] = static_cast<uint8_t>(low | (high << 4));
  }
}
#endif

// r = x + s in x's dtype (one fp32 add rounded once); s may be r itself (each element is read, then written).
template <typename scalar_t>
inline void accumulate(const scalar_t* x, const scalar_t* s, scalar_t* r, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) r[i] = static_cast<scalar_t>(static_cast<float>(x[i]) + static_cast<float>(s[i]));
}

// residual = acc - (+scale or -scale), the acc being the residual buffer itself. A select, not a branch:
// signs are random, so a branch would mispredict half the time; -scale is scale with its sign bit flipped.
template <typename scalar_t>
inline void subtract_signs(scalar_t* acc, float scale, int64_t len) {
  const float minus = -scale;
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    const float a = static_cast<float>(acc[i]);
    acc[i] = static_cast<scalar_t>(a - (a >= 0.0f ? scale : minus));
  }
}

// Whole bytes of bits (as pack_signs_bytes) and residual = acc - (±scale) (as subtract_signs), in one pass.
template <typename scalar_t>
inline void pack_and_subtract(scalar_t* acc, int64_t nbytes, float scale, uint8_t* out) {
  pack_signs_bytes(acc, nbytes, out);
  subtract_signs(acc, scale, nbytes * 8);
}

#if defined(__SSE2__)
template <>
inline void pack_and_subtract<float>(float* acc, int64_t nbytes, float scale, uint8_t* out) {
  const __m128 zero = _mm_setzero_ps();
  const __m128 plus = _mm_set1_ps(scale);
  const __m128 minus = _mm_set1_ps(-scale);
  for (int64_t j = 0; j < nbytes; ++j) {
    float* a = acc + 8 * j;
    const __m128 low = _mm_loadu_ps(a);
    const __m128 high = _mm_loadu_ps(a + 4);
    const __m128 low_ge = _mm_cmpge_ps(low, zero);
    const __m128 high_ge = _mm_cmpge_ps(high, zero);
    out[j] = static_cast<uint8_t>(_mm_movemask_ps(low_ge) | (_mm_movemask_ps(high_ge) << 4));
    const __m128 low_sent = _mm_or_ps(_mm_and_ps(low_ge, plus), _mm_andnot_ps(low_ge, minus));
    const __m128 high_sent = _mm_or_ps(_mm_and_ps(high_ge, plus), _mm_andnot_ps(high_ge, minus));
    _mm_storeu_ps(a, _mm_sub_ps(low, low_sent));
    _mm_storeu_ps(a + 4, _mm_sub_ps(high, high_sent));
  }
}
#endif

// What one range of chunks needs; residual and source are null without error feedback.
template <typename scalar_t>
struct SignJob {
  const scalar_t* x;
  const scalar_t* source;  // residual_source, or the residual itself for the in-place form
  scalar_t* residual;      // overwritten with acc - sent
  uint8_t* packed;         // zeroed: bits of a chunk that starts inside a byte are OR-ed in
  float* scales;
  int64_t n;
  int64_t chunk;
};

// Chunks [c_lo, c_hi). Groups of kSumGroup whole chunks are processed together while they fit in cache
// (their sums interleave). Only the first pass over a group streams from memory: the accumulation with
// feedback, else the sign bits (which do not need the scale); the sums and the residual update then read
// the group from L1/L2.
template <typename scalar_t, bool FEEDBACK>
inline void sign_compress_range(const SignJob<scalar_t>& job, int64_t c_lo, int64_t c_hi) {
  constexpr int G = kSumGroup<scalar_t>;
  const bool grouped = G > 1 && job.chunk * G * static_cast<int64_t>(sizeof(scalar_t)) <= (int64_t{64} << 10);
  for (int64_t c = c_lo; c < c_hi;) {
    const int64_t first = c * job.chunk;
    const bool group = grouped && c + G <= c_hi && first + G * job.chunk <= job.n;
    const int64_t count = group ? G : 1;
    const int64_t span = std::min(count * job.chunk, job.n - first);  // elements of these chunks
    const int64_t len = group ? job.chunk : span;  // elements of each chunk summed together
    const scalar_t* acc = FEEDBACK ? job.residual + first : job.x + first;
    // Sign bits: whole bytes where a chunk starts on one; the rest bit by bit (OR-ed: a partial byte is
    // shared with the neighbouring chunk). Without feedback they are the first pass; with it they are
    // stored in the residual update's pass, once the scale is known.
    auto pack = [&](int64_t g, const scalar_t* a, bool whole_bytes) {
      const int64_t start = first + g * job.chunk;
      const int64_t size = std::min(job.chunk, job.n - start);
      const int64_t done = start % 8 == 0 ? size / 8 * 8 : 0;
      if (whole_bytes && done > 0) pack_signs_bytes(a, done / 8, job.packed + start / 8);
      for (int64_t j = done; j < size; ++j) {
        const int64_t i = start + j;
        job.packed[i >> 3] |= static_cast<uint8_t>((static_cast<float>(a[j]) >= 0.0f) << (i & 7));
      }
    };
    double totals[G];
    auto sum = [&](auto sums) {
      const int64_t main = sums.main_part(len);
      if (FEEDBACK) {
        // One sequential stream; interleaving it with the sums tile by tile (4 chunks, 12 streams) is slower.
        accumulate(job.x + first, job.source + first, job.residual + first, span);
      } else {
        for (int64_t g = 0; g < count; ++g) pack(g, acc + g * job.chunk, true);
      }
      sums.add(acc, job.chunk, 0, main);
      sums.finish(acc, job.chunk, len, totals);
    };
    if (group) {
      sum(LaneSums<G, scalar_t>());
    } else {
      sum(LaneSums<1, scalar_t>());
    }
    for (int64_t g = 0; g < count; ++g) {
      const int64_t start = first + g * job.chunk;
      const int64_t size = std::min(job.chunk, job.n - start);
      const float scale = static_cast<float>(totals[g] / static_cast<double>(size));
      job.scales[c + g] = scale;
      if (FEEDBACK) {
        scalar_t* r = job.residual + start;
        pack(g, r, false);  // the bits outside whole bytes, before r is overwritten
        const int64_t whole = start % 8 == 0 ? size / 8 : 0;
        pack_and_subtract(r, whole, scale, job.packed + start / 8);
        subtract_signs(r + whole * 8, scale, size - whole * 8);
      }
    }
    c += count;
  }
}

template <typename scalar_t, bool FEEDBACK>
FASTCOMM_AVX2 void sign_compress_range_avx2(const SignJob<scalar_t>& job, int64_t c_lo, int64_t c_hi) {
  sign_compress_range<scalar_t, FEEDBACK>(job, c_lo, c_hi);
}

// kByteMasks[b] holds 8 bytes, byte t being 0xFF where bit t of b is set and 0 where it is not.
struct ByteMasks {
  uint64_t value[256];
  constexpr ByteMasks() : value() {
    for (int b = 0; b < 256; ++b) {
      for (int t = 0; t < 8; ++t) value[b] |= ((b >> t) & 1) ? uint64_t{0xFF} << (8 * t) : 0;
    }
  }
};
constexpr ByteMasks kByteMasks;

// out = (or +=, in fp32 rounded once) +scale where the bit is 1 and -scale where it is 0, for m values whose
// bits start on a byte boundary. The bits are first spread to one mask byte per value (a table lookup per
// byte), so the select runs over contiguous lanes; a simd loop straight over the packed bytes would store
// each byte's 8 values with 8-way strided stores.
template <bool ACCUMULATE, typename scalar_t>
inline void unpack_signs(const uint8_t* bits, int64_t m, float scale, scalar_t* out) {
  constexpr int64_t kTile = 1024;
  const float minus = -scale;
  const scalar_t plus_d = static_cast<scalar_t>(scale);
  const scalar_t minus_d = static_cast<scalar_t>(minus);
  uint8_t mask[kTile];
  for (int64_t off = 0; off < m; off += kTile) {
    const int64_t len = std::min(kTile, m - off);
    const uint8_t* b = bits + off / 8;
    for (int64_t j = 0; j < ceil_div(len, 8); ++j) std::memcpy(mask + 8 * j, &kByteMasks.value[b[j]], 8);
    scalar_t* o = out + off;
    if (ACCUMULATE) {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) o[i] = static_cast<scalar_t>(static_cast<float>(o[i]) + (mask[i] ? scale : minus));
    } else {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) o[i] = mask[i] ? plus_d : minus_d;
    }
  }
}

// Chunks [c_lo, c_hi) of numel values into out.
template <typename scalar_t, bool ACCUMULATE>
inline void sign_decompress_range(const uint8_t* bits, const float* scales, int64_t numel, int64_t chunk,
                                  scalar_t* out, int64_t c_lo, int64_t c_hi) {
  for (int64_t c = c_lo; c < c_hi; ++c) {
    const float scale = scales[c];
    const int64_t first = c * chunk;
    const int64_t last = std::min(numel, first + chunk);
    if (first % 8 == 0) {
      unpack_signs<ACCUMULATE>(bits + first / 8, last - first, scale, out + first);
    } else {  // a chunk that starts inside a byte
      for (int64_t i = first; i < last; ++i) {
        const float value = ((bits[i >> 3] >> (i & 7)) & 1) ? scale : -scale;
        out[i] = static_cast<scalar_t>(ACCUMULATE ? static_cast<float>(out[i]) + value : value);
      }
    }
  }
}

template <typename scalar_t, bool ACCUMULATE>
FASTCOMM_AVX2 void sign_decompress_range_avx2(const uint8_t* bits, const float* scales, int64_t numel,
                                              int64_t chunk, scalar_t* out, int64_t c_lo, int64_t c_hi) {
  sign_decompress_range<scalar_t, ACCUMULATE>(bits, scales, numel, chunk, out, c_lo, c_hi);
}

template <typename scalar_t>
using SignDecompressRangeFn = void (*)(const uint8_t*, const float*, int64_t, int64_t, scalar_t*, int64_t, int64_t);

// out (contiguous, numel = out.numel()) = or += the first numel values of (packed, scales).
void sign_decompress_into_impl(const at::Tensor& out, const at::Tensor& packed, const at::Tensor& scales,
                               int64_t chunk, bool accumulate, const char* op) {
  TORCH_CHECK_VALUE(chunk > 0, op, ": chunk must be positive, got ", chunk);
  TORCH_CHECK_VALUE(out.is_contiguous(), op, ": out must be contiguous");
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte, op, ": packed must be uint8, got ", packed.scalar_type());
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat, op, ": scales must be float32, got ", scales.scalar_type());
  const int64_t numel = out.numel();
  const int64_t nbytes = ceil_div(numel, 8);
  const int64_t nchunks = ceil_div(numel, chunk);
  const at::Tensor pc = payload_prefix(op, "packed", packed, nbytes, "bytes");
  const at::Tensor sc = payload_prefix(op, "scales", scales, nchunks, "elements");
  if (numel == 0) return;
  const bool avx2 = use_avx2();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "sign_decompress_cpu", [&] {
    SignDecompressRangeFn<scalar_t> fn;
    if (accumulate) {
      fn = avx2 ? &sign_decompress_range_avx2<scalar_t, true> : &sign_decompress_range<scalar_t, true>;
    } else {
      fn = avx2 ? &sign_decompress_range_avx2<scalar_t, false> : &sign_decompress_range<scalar_t, false>;
    }
    const uint8_t* bp = pc.const_data_ptr<uint8_t>();
    const float* sp = sc.const_data_ptr<float>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, nchunks, std::max<int64_t>(1, 65536 / chunk), [&](int64_t lo, int64_t hi) {
      fn(bp, sp, numel, chunk, o, lo, hi);
    });
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sign_compress_cpu(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                     int64_t chunk, const std::optional<at::Tensor>& residual_source) {
  TORCH_CHECK_VALUE(chunk > 0, "sign_compress: chunk must be positive, got ", chunk);
  const at::Tensor flat = x.contiguous().view(-1);
  const int64_t n = flat.numel();
  const int64_t nchunks = ceil_div(n, chunk);
  const ResidualBuffers buffers("sign_compress", x, residual, residual_source);
  at::Tensor packed = x.new_zeros({ceil_div(n, 8)}, at::kByte);
  at::Tensor scales = x.new_empty({nchunks}, at::kFloat);
  int64_t unit = 1;
  while ((unit * chunk) % 8 != 0) ++unit;
  const int64_t units = ceil_div(nchunks, unit);
  const bool avx2 = use_avx2();
  const bool feedback = buffers.feedback();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "sign_compress_cpu", [&] {
    SignJob<scalar_t> job;
    job.x = flat.const_data_ptr<scalar_t>();
    job.source = buffers.source_data<scalar_t>();
    job.residual = buffers.residual_data<scalar_t>();
    job.packed = packed.data_ptr<uint8_t>();
    job.scales = scales.data_ptr<float>();
    job.n = n;
    job.chunk = chunk;
    void (*fn)(const SignJob<scalar_t>&, int64_t, int64_t);
    if (feedback) {
      fn = avx2 ? &sign_compress_range_avx2<scalar_t, true> : &sign_compress_range<scalar_t, true>;
    } else {
      fn = avx2 ? &sign_compress_range_avx2<scalar_t, false> : &sign_compress_range<scalar_t, false>;
    }
    at::parallel_for(0, units, std::max<int64_t>(1, 65536 / (unit * chunk)), [&](int64_t lo, int64_t hi) {
      fn(job, lo * unit, std::min(nchunks, hi * unit));
    });
  });
  buffers.finish(residual);
  return {packed, scales};
}

at::Tensor sign_decompress_cpu(const at::Tensor& packed, const at::Tensor& scales, int64_t numel, int64_t chunk,
                               at::ScalarType dtype) {
  TORCH_CHECK_VALUE(chunk > 0, "sign_decompress: chunk must be positive, got ", chunk);
  TORCH_CHECK_VALUE(packed.numel() == ceil_div(numel, 8), "sign_decompress: packed has ", packed.numel(),
                    " bytes, expected ", ceil_div(numel, 8));
  TORCH_CHECK_VALUE(scales.numel() == ceil_div(numel, chunk), "sign_decompress: scales has ", scales.numel(),
                    " elements, expected ", ceil_div(numel, chunk));
  at::Tensor out = packed.new_empty({numel}, dtype);
  sign_decompress_into_impl(out, packed, scales, chunk, /*accumulate=*/false, "sign_decompress");
  return out;
}

void sign_decompress_into_cpu(const at::Tensor& out, const at::Tensor& packed, const at::Tensor& scales,
                              int64_t chunk, bool accumulate) {
  sign_decompress_into_impl(out, packed, scales, chunk, accumulate, "sign_decompress_into");
}

}  // namespace fastcomm
