// Top-k magnitude selection with error feedback on CPU: a radix histogram instead of a sort.
//
// Exact: pass 1 forms acc = x + residual and histograms the high 15 bits of each magnitude key; the bin
// holding the k-th largest key is found by a scan from the top; pass 2 collects every index above that bin
// plus the (few) candidates inside it, and the exact threshold among candidates is found by nth_element.
// Approximate: the threshold comes from a hashed sample (reference._approx_threshold), so one pass suffices.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "comm/kernels.h"

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

template <typename scalar_t>
std::vector<int32_t> select_exact(const scalar_t* x, scalar_t* residual, int64_t n, int64_t k) {
  const Ranges ranges(n);
  const scalar_t* acc = residual != nullptr ? residual : x;
  std::vector<std::vector<uint32_t>> hist(ranges.count, std::vector<uint32_t>(kBins, 0));
  for_each_range(ranges, [&](int64_t r, int64_t b, int64_t e) {
    uint32_t* h = hist[r].data();
    if (residual != nullptr) {
      for (int64_t i = b; i < e; ++i) {
        const scalar_t a = add_in_dtype(x[i], residual[i]);
        residual[i] = a;
        ++h[key_of(a) >> kBinShift];
      }
    } else {
      for (int64_t i = b; i < e; ++i) ++h[key_of(x[i]) >> kBinShift];
    }
  });
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
    for (int64_t i = b; i < e; ++i) {
      const uint32_t high = key_of(acc[i]) >> kBinShift;
      if (high > cut) {
        sure[r].push_back(static_cast<int32_t>(i));
      } else if (high == cut) {
        candidates[r].push_back(static_cast<int32_t>(i));
      }
    }
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

template <typename scalar_t>
std::vector<int32_t> select_approx(const scalar_t* x, scalar_t* residual, int64_t n, int64_t k,
                                   std::vector<scalar_t>& values) {
  const int64_t m = approx_sample_size(n, k);
  const int64_t stride = n / m;
  const int64_t rank = std::max<int64_t>(1, ceil_div(m * k, n));
  std::vector<uint32_t> sample(m);
  at::parallel_for(0, m, 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) {
      const int64_t p = s * stride + static_cast<int64_t>(hash32(static_cast<uint64_t>(s), 0) % stride);
      sample[s] = key_of(residual != nullptr ? add_in_dtype(x[p], residual[p]) : x[p]);
    }
  });
  std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(), std::greater<uint32_t>());
  const uint32_t threshold = sample[rank - 1];
  const Ranges ranges(n);
  std::vector<std::vector<int32_t>> picked(ranges.count);
  std::vector<std::vector<scalar_t>> picked_values(ranges.count);
  for_each_range(ranges, [&](int64_t r, int64_t b, int64_t e) {
    auto& idx = picked[r];
    auto& val = picked_values[r];
    if (residual != nullptr) {
      for (int64_t i = b; i < e; ++i) {
        const scalar_t a = add_in_dtype(x[i], residual[i]);
        const bool send = key_of(a) >= threshold;
        residual[i] = send ? static_cast<scalar_t>(0) : a;
        if (send) {
          idx.push_back(static_cast<int32_t>(i));
          val.push_back(a);
        }
      }
    } else {
      for (int64_t i = b; i < e; ++i) {
        if (key_of(x[i]) >= threshold) {
          idx.push_back(static_cast<int32_t>(i));
          val.push_back(x[i]);
        }
      }
    }
  });
  std::vector<int32_t> selected;
  for (int64_t r = 0; r < ranges.count; ++r) {
    selected.insert(selected.end(), picked[r].begin(), picked[r].end());
    values.insert(values.end(), picked_values[r].begin(), picked_values[r].end());
  }
  return selected;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> topk_select_cpu(const at::Tensor& x, int64_t k,
                                                   const std::optional<at::Tensor>& residual, bool exact) {
  const int64_t n = x.numel();
  TORCH_CHECK(k >= 0 && k <= n, "topk_select: k must be in [0, ", n, "], got ", k);
  TORCH_CHECK(n <= std::numeric_limits<int32_t>::max(), "topk_select: int32 indices limit x to 2^31-1 elements");
  const at::Tensor flat = x.contiguous().view(-1);
  at::Tensor work;  // the residual buffer the kernel updates (a contiguous copy when the caller's is not)
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "topk_select: residual must match x in shape and dtype");
    work = residual->is_contiguous() ? *residual : residual->contiguous();
  }
  at::Tensor values, indices;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "topk_select_cpu", [&] {
    const scalar_t* xp = flat.const_data_ptr<scalar_t>();
    scalar_t* rp = work.defined() ? work.data_ptr<scalar_t>() : nullptr;
    std::vector<int32_t> selected;
    if (k == 0 || n == 0) {
      if (rp != nullptr) {
        for (int64_t i = 0; i < n; ++i) rp[i] = add_in_dtype(xp[i], rp[i]);
      }
      values = at::empty({0}, x.options());
    } else if (exact || approx_sample_size(n, k) * 2 > n) {
      selected = select_exact(xp, rp, n, k);
      values = at::empty({k}, x.options());
      scalar_t* vp = values.data_ptr<scalar_t>();
      const scalar_t* acc = rp != nullptr ? rp : xp;
      at::parallel_for(0, k, 1 << 14, [&](int64_t lo, int64_t hi) {
        for (int64_t j = lo; j < hi; ++j) {
          vp[j] = acc[selected[j]];
          if (rp != nullptr) rp[selected[j]] = static_cast<scalar_t>(0);
        }
      });
    } else {
      std::vector<scalar_t> picked;
      selected = select_approx(xp, rp, n, k, picked);
      values = at::empty({static_cast<int64_t>(picked.size())}, x.options());
      std::copy(picked.begin(), picked.end(), values.data_ptr<scalar_t>());
    }
    indices = at::empty({static_cast<int64_t>(selected.size())}, x.options().dtype(at::kInt));
    std::copy(selected.begin(), selected.end(), indices.data_ptr<int32_t>());
  });
  if (work.defined() && !work.is_same(*residual)) residual->copy_(work);
  return {values, indices};
}

}  // namespace fastcomm
