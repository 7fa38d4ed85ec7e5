// Top-k magnitude selection with error feedback on CPU: a radix histogram instead of a sort.
//
// acc = x + source, where source is residual_source or the residual itself (the in-place form); the residual
// is only written (acc, then zero where an entry is sent), so with a separate source no copy is needed.
// Exact: pass 1 forms acc and histograms the high 15 bits of each magnitude key; the bin holding the k-th
// largest key is found by a scan from the top; pass 2 collects every index above that bin plus the (few)
// candidates inside it, and the exact threshold among candidates is found by nth_element.
// Approximate: the threshold comes from a hashed sample (reference._approx_threshold), so one pass suffices.
//
// The fp32 loops also have an AVX2 build (cpu_isa.h) that takes 8 elements a step: the add, the keys, their
// comparison and the residual update stay in vector registers, and a movemask, almost always zero, says
// which lanes are selected; those are appended in ascending order by their set bits. The approximate pass
// stores a large residual non-temporally: nothing reads it before the next step, and a store through the
// cache would first read every line in (a third of the pass's memory traffic). fp16/bf16 and machines
// without AVX2 run the scalar loops, which give the same bits (the same IEEE fp32 add, the same integer keys).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "comm/cpu_isa.h"
#include "comm/kernels.h"

#if FASTCOMM_HAVE_AVX2
#include <immintrin.h>
#endif

namespace fastcomm {
namespace {

constexpr int kBinShift = 16;
constexpr int64_t kBins = int64_t{1} << 15;  // keys are < 2^31

// Contiguous index ranges, in ascending order, processed in parallel; per-range buffers keep output ordered.
struct Ranges {
  int64_t n;
  int64_t size;
  int64_t count;
  explicit Ranges(int64_t n_) : n(n_) {
    const int64_t wanted = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads() * 4, ceil_div(n_, 1 << 16)));
    size = std::max<int64_t>(1, ceil_div(n_, wanted));
    count = n_ == 0 ? 0 : ceil_div(n_, size);
  }
  int64_t begin(int64_t r) const { return r * size; }
  int64_t end(int64_t r) const { return std::min(n, (r + 1) * size); }
};

template <typename F>
void for_each_range(const Ranges& ranges, const F& fn) {
  at::parallel_for(0, ranges.count, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) fn(r, ranges.begin(r), ranges.end(r));
  });
}

template <typename scalar_t>
inline scalar_t add_in_dtype(scalar_t a, scalar_t b) {
  return static_cast<scalar_t>(static_cast<float>(a) + static_cast<float>(b));
}

template <typename scalar_t>
inline uint32_t key_of(scalar_t v) {
  return magnitude_key(static_cast<float>(v));
}

// One call's operands; source and residual are null without error feedback.
template <typename scalar_t>
struct SelectJob {
  const scalar_t* x;
  const scalar_t* source;  // residual_source, or the residual itself for the in-place form
  scalar_t* residual;      // written only: acc (exact pass 1) or acc with the sent entries zeroed
  int64_t n;
  int64_t k;
  bool stream;  // the approximate pass stores the residual non-temporally (worth_streaming)

  scalar_t acc(int64_t i) const { return source != nullptr ? add_in_dtype(x[i], source[i]) : x[i]; }
};

// What one range selected, in ascending index order.
template <typename scalar_t>
struct Picked {
  std::vector<int32_t> indices;
  std::vector<scalar_t> values;
};

// Exact pass 1 over [b, e): residual = acc (with feedback) and the histogram of the keys' high bits.
template <typename scalar_t, bool FEEDBACK>
inline void histogram_range(const SelectJob<scalar_t>& job, int64_t b, int64_t e, uint32_t* hist) {
  for (int64_t i = b; i < e; ++i) {
    const scalar_t a = FEEDBACK ? add_in_dtype(job.x[i], job.source[i]) : job.x[i];
    if (FEEDBACK) job.residual[i] = a;
    ++hist[key_of(a) >> kBinShift];
  }
}

// Exact pass 2 over [b, e) of acc: indices whose key lies above the cut bin, and those inside it.
template <typename scalar_t>
inline void collect_range(const scalar_t* acc, uint32_t cut, int64_t b, int64_t e, std::vector<int32_t>& sure,
                          std::vector<int32_t>& candidates) {
  for (int64_t i = b; i < e; ++i) {
    const uint32_t high = key_of(acc[i]) >> kBinShift;
    if (high > cut) {
      sure.push_back(static_cast<int32_t>(i));
    } else if (high == cut) {
      candidates.push_back(static_cast<int32_t>(i));
    }
  }
}

// Approximate selection over [b, e): every key >= threshold is sent; residual = acc, zero where sent.
template <typename scalar_t, bool FEEDBACK>
inline void threshold_range(const SelectJob<scalar_t>& job, uint32_t threshold, int64_t b, int64_t e,
                            Picked<scalar_t>& out) {
  for (int64_t i = b; i < e; ++i) {
    const scalar_t a = FEEDBACK ? add_in_dtype(job.x[i], job.source[i]) : job.x[i];
    const bool send = key_of(a) >= threshold;
    if (FEEDBACK) job.residual[i] = send ? static_cast<scalar_t>(0) : a;
    if (send) {
      out.indices.push_back(static_cast<int32_t>(i));
      out.values.push_back(a);
    }
  }
}

#if FASTCOMM_HAVE_AVX2
// The fp32 loops above, 8 elements a step, the tail by the scalar loops. Keys are below 2^31, so the signed
// 32-bit compares of AVX2 order them as the unsigned scalar compares do.
inline __attribute__((target("avx2"))) __m256i keys8(__m256 a) {
  return _mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7FFFFFFF));
}

template <bool FEEDBACK>
FASTCOMM_AVX2 void histogram_range_avx2(const SelectJob<float>& job, int64_t b, int64_t e, uint32_t* hist) {
  alignas(32) uint32_t bins[8];
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    __m256 a = _mm256_loadu_ps(job.x + i);
    if (FEEDBACK) {
      a = _mm256_add_ps(a, _mm256_loadu_ps(job.source + i));
      _mm256_storeu_ps(job.residual + i, a);
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(bins), _mm256_srli_epi32(keys8(a), kBinShift));
    for (int t = 0; t < 8; ++t) ++hist[bins[t]];
  }
  histogram_range<float, FEEDBACK>(job, i, e, hist);
}

FASTCOMM_AVX2 void collect_range_avx2(const float* acc, uint32_t cut, int64_t b, int64_t e,
                                      std::vector<int32_t>& sure, std::vector<int32_t>& candidates) {
  const __m256i below = _mm256_set1_epi32(static_cast<int32_t>(cut) - 1);  // high >= cut
  alignas(32) uint32_t highs[8];
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    const __m256i high = _mm256_srli_epi32(keys8(_mm256_loadu_ps(acc + i)), kBinShift);
    int mask = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(high, below)));
    if (mask != 0) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(highs), high);
      do {
        const int t = __builtin_ctz(static_cast<unsigned>(mask));
        (highs[t] > cut ? sure : candidates).push_back(static_cast<int32_t>(i + t));
        mask &= mask - 1;
      } while (mask != 0);
    }
  }
  collect_range(acc, cut, i, e, sure, candidates);
}

template <bool FEEDBACK>
FASTCOMM_AVX2 void threshold_range_avx2(const SelectJob<float>& job, uint32_t threshold, int64_t b, int64_t e,
                                        Picked<float>& out) {
  const __m256i below = _mm256_set1_epi32(static_cast<int32_t>(threshold) - 1);  // key >= threshold
  alignas(32) float lanes[8];
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    __m256 a = _mm256_loadu_ps(job.x + i);
    if (FEEDBACK) a = _mm256_add_ps(a, _mm256_loadu_ps(job.source + i));
    const __m256 send = _mm256_castsi256_ps(_mm256_cmpgt_epi32(keys8(a), below));
    if (FEEDBACK) {
      const __m256 kept = _mm256_andnot_ps(send, a);  // +0.0 where sent
      float* to = job.residual + i;
      if (job.stream && (reinterpret_cast<std::uintptr_t>(to) & 31) == 0) {
        _mm256_stream_ps(to, kept);  // read again only next step: no read of the line into the cache first
      } else {
        _mm256_storeu_ps(to, kept);
      }
    }
    int mask = _mm256_movemask_ps(send);
    if (mask != 0) {
      _mm256_store_ps(lanes, a);
      do {
        const int t = __builtin_ctz(static_cast<unsigned>(mask));
        out.indices.push_back(static_cast<int32_t>(i + t));
        out.values.push_back(lanes[t]);
        mask &= mask - 1;
      } while (mask != 0);
    }
  }
  if (FEEDBACK && job.stream) _mm_sfence();
  threshold_range<float, FEEDBACK>(job, threshold, i, e, out);
}
#endif

template <typename scalar_t>
using HistogramFn = void (*)(const SelectJob<scalar_t>&, int64_t, int64_t, uint32_t*);
template <typename scalar_t>
using CollectFn = void (*)(const scalar_t*, uint32_t, int64_t, int64_t, std::vector<int32_t>&,
                           std::vector<int32_t>&);
template <typename scalar_t>
using ThresholdFn = void (*)(const SelectJob<scalar_t>&, uint32_t, int64_t, int64_t, Picked<scalar_t>&);

// The build of each loop this call runs: AVX2 for fp32 where the machine has it, else the scalar loops.
template <typename scalar_t>
struct Loops {
  HistogramFn<scalar_t> histogram;
  CollectFn<scalar_t> collect;
  ThresholdFn<scalar_t> threshold;

  explicit Loops(bool feedback) {
    histogram = feedback ? &histogram_range<scalar_t, true> : &histogram_range<scalar_t, false>;
    collect = &collect_range<scalar_t>;
    threshold = feedback ? &threshold_range<scalar_t, true> : &threshold_range<scalar_t, false>;
#if FASTCOMM_HAVE_AVX2
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (use_avx2()) {
        histogram = feedback ? &histogram_range_avx2<true> : &histogram_range_avx2<false>;
        collect = &collect_range_avx2;
        threshold = feedback ? &threshold_range_avx2<true> : &threshold_range_avx2<false>;
      }
    }
#endif
  }
};

// Room for about twice the expected share of k in a range of len elements, so appends rarely reallocate.
inline int64_t expected_picks(int64_t k, int64_t n, int64_t len) { return 2 * k * len / std::max<int64_t>(1, n) + 64; }

template <typename scalar_t>
std::vector<int32_t> select_exact(const SelectJob<scalar_t>& job, const Loops<scalar_t>& loops) {
  const int64_t n = job.n;
  const int64_t k = job.k;
  const Ranges ranges(n);
  const scalar_t* acc = job.residual != nullptr ? job.residual : job.x;
  std::vector<std::vector<uint32_t>> hist(ranges.count, std::vector<uint32_t>(kBins, 0));
  for_each_range(ranges, [&](int64_t r, int64_t b, int64_t e) { loops.histogram(job, b, e, hist[r].data()); });
  // The bin holding the k-th largest key, and how many keys lie strictly above it.
  int64_t above = 0;
  int64_t bin = kBins - 1;
  for (; bin >= 0; --bin) {
    int64_t in_bin = 0;
    for (int64_t r = 0; r < ranges.count; ++r) in_bin += hist[r][bin];
    if (above + in_bin >= k) break;
    above += in_bin;
  }
  const uint32_t cut = static_cast<uint32_t>(bin);
  std::vector<std::vector<int32_t>> sure(ranges.count), candidates(ranges.count);
  for_each_range(ranges, [&](int64_t r, int64_t b, int64_t e) {
    sure[r].reserve(expected_picks(above, n, e - b));
    loops.collect(acc, cut, b, e, sure[r], candidates[r]);
  });
  std::vector<int32_t> sure_all, cand_all;
  sure_all.reserve(above);
  for (auto& v : sure) sure_all.insert(sure_all.end(), v.begin(), v.end());
  for (auto& v : candidates) cand_all.insert(cand_all.end(), v.begin(), v.end());
  const int64_t need = k - above;  // >= 1: the k-th largest lies in this bin
  std::vector<uint32_t> cand_keys(cand_all.size());
  for (size_t j = 0; j < cand_all.size(); ++j) cand_keys[j] = key_of(acc[cand_all[j]]);
  std::vector<uint32_t> sorted_keys = cand_keys;
  std::nth_element(sorted_keys.begin(), sorted_keys.begin() + (need - 1), sorted_keys.end(), std::greater<uint32_t>());
  const uint32_t threshold = sorted_keys[need - 1];
  int64_t greater = 0;
  for (uint32_t key : cand_keys) greater += key > threshold;
  int64_t ties_left = need - greater;
  std::vector<int32_t> chosen;
  chosen.reserve(need);
  for (size_t j = 0; j < cand_all.size(); ++j) {
    if (cand_keys[j] > threshold) {
      chosen.push_back(cand_all[j]);
    } else if (cand_keys[j] == threshold && ties_left > 0) {
      chosen.push_back(cand_all[j]);
      --ties_left;
    }
  }
  std::vector<int32_t> selected(k);
  std::merge(sure_all.begin(), sure_all.end(), chosen.begin(), chosen.end(), selected.begin());
  return selected;
}

// (values, indices) of every key at or above the sampled threshold, and the residual update, in one pass.
template <typename scalar_t>
std::tuple<at::Tensor, at::Tensor> select_approx(const SelectJob<scalar_t>& job, const Loops<scalar_t>& loops,
                                                 const at::Tensor& x) {
  const int64_t n = job.n;
  const int64_t k = job.k;
  const int64_t m = approx_sample_size(n, k);
  const int64_t stride = n / m;
  const int64_t rank = std::max<int64_t>(1, ceil_div(m * k, n));
  std::vector<uint32_t> sample(m);
  // The positions first, then their reads with prefetches kPrefetchAhead samples ahead: each sample is a
  // cache miss (sampled ~1 in stride elements of a tensor larger than the caches), and a loop computing the
  // position of each read just before it keeps only a few in flight (16.8M elements, k = 1%: 100K samples,
  // 1.4 ms against 2.3-6.6 ms, measured in isolation).
  std::vector<int64_t> where(m);
  at::parallel_for(0, m, 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) {
      where[s] = s * stride + static_cast<int64_t>(hash32(static_cast<uint64_t>(s), 0) % stride);
    }
    for (int64_t s = lo; s < hi; ++s) {
      if (s + kPrefetchAhead < hi) {
        __builtin_prefetch(job.x + where[s + kPrefetchAhead]);
        if (job.source != nullptr) __builtin_prefetch(job.source + where[s + kPrefetchAhead]);
      }
      sample[s] = key_of(job.acc(where[s]));
    }
  });
  std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(), std::greater<uint32_t>());
  const uint32_t threshold = sample[rank - 1];
  const Ranges ranges(n);
  std::vector<Picked<scalar_t>> picked(ranges.count);
  for_each_range(ranges, [&](int64_t r, int64_t b, int64_t e) {
    picked[r].indices.reserve(expected_picks(k, n, e - b));
    picked[r].values.reserve(expected_picks(k, n, e - b));
    loops.threshold(job, threshold, b, e, picked[r]);
  });
  std::vector<int64_t> offset(ranges.count + 1, 0);
  for (int64_t r = 0; r < ranges.count; ++r) offset[r + 1] = offset[r] + picked[r].indices.size();
  at::Tensor values = x.new_empty({offset[ranges.count]});
  at::Tensor indices = x.new_empty({offset[ranges.count]}, at::kInt);
  scalar_t* vp = values.data_ptr<scalar_t>();
  int32_t* ip = indices.data_ptr<int32_t>();
  for_each_range(ranges, [&](int64_t r, int64_t, int64_t) {
    std::copy(picked[r].indices.begin(), picked[r].indices.end(), ip + offset[r]);
    std::copy(picked[r].values.begin(), picked[r].values.end(), vp + offset[r]);
  });
  return {values, indices};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> topk_select_cpu(const at::Tensor& x, int64_t k,
                                                   const std::optional<at::Tensor>& residual, bool exact,
                                                   const std::optional<at::Tensor>& residual_source) {
  const int64_t n = x.numel();
  TORCH_CHECK_VALUE(k >= 0 && k <= n, "topk_select: k must be in [0, ", n, "], got ", k);
  TORCH_CHECK_VALUE(n <= std::numeric_limits<int32_t>::max(),
                    "topk_select: int32 indices limit x to 2^31-1 elements");
  const at::Tensor flat = x.contiguous().view(-1);
  const ResidualBuffers buffers("topk_select", x, residual, residual_source);
  at::Tensor values, indices;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "topk_select_cpu", [&] {
    SelectJob<scalar_t> job;
    job.x = flat.const_data_ptr<scalar_t>();
    job.source = buffers.source_data<scalar_t>();
    job.residual = buffers.residual_data<scalar_t>();
    job.n = n;
    job.k = k;
    job.stream = job.residual != nullptr && worth_streaming(n * static_cast<int64_t>(sizeof(scalar_t)));
    const Loops<scalar_t> loops(buffers.feedback());
    if (k == 0 || n == 0) {
      if (job.residual != nullptr) {
        at::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
          for (int64_t i = lo; i < hi; ++i) job.residual[i] = job.acc(i);
        });
      }
      values = x.new_empty({0});
      indices = x.new_empty({0}, at::kInt);
    } else if (exact || approx_sample_size(n, k) * 2 > n) {
      const std::vector<int32_t> selected = select_exact(job, loops);
      values = x.new_empty({k});
      indices = x.new_empty({k}, at::kInt);
      scalar_t* vp = values.data_ptr<scalar_t>();
      int32_t* ip = indices.data_ptr<int32_t>();
      scalar_t* rp = job.residual;
      const scalar_t* acc = rp != nullptr ? rp : job.x;
      at::parallel_for(0, k, 1 << 14, [&](int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) {
          ip[j] = selected[j];
          vp[j] = acc[selected[j]];
          if (rp != nullptr) rp[selected[j]] = static_cast<scalar_t>(0);
        }
      });
    } else {
      std::tie(values, indices) = select_approx(job, loops, x);
    }
  });
  buffers.finish(residual);
  return {values, indices};
}

}  // namespace fastcomm
