// PowerSGD's three passes over a gradient matrix on CPU, each reading it once (fastcomm/reference.py has
// their plain-PyTorch twins):
//
//   powersgd_project: x = gradient + residual (optional), then p = x q_t^T, in one pass over the rows: a
//     row of x is formed, written and multiplied by the r rows of q_t while it is in cache. torch does the
//     sum and the product as two passes over the whole matrix (the product a rank-r GEMM that reads x again).
//   powersgd_back_project: q_t = p^T x, a column tile of q_t at a time (it stays in cache while the rows of x
//     stream past once, four rows per load and store of the tile); MKL's rank-r GEMM read x at 7 GB/s here.
//   powersgd_expand: a = p q_t; mean = a; residual -= a (optional), in one pass: a row of a is never
//     written to memory before the residual update reads it. torch writes a, then reads it back.
//
// Every row is independent (parallel over rows: the bits do not depend on the thread count). Sums run in a
// fixed order on 8-float lanes written with GCC/Clang vector extensions: lane-wise IEEE operations that the
// compiler cannot reorder, so the baseline and AVX2 copies (cpu_isa.h) give the same bits. The order
// differs from MKL's GEMM, so the twins agree within fp32 rounding, not bit for bit.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "comm/cpu_isa.h"
#include "comm/kernels.h"

namespace fastcomm {

std::atomic<bool>& streaming_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

// 16 MB: the last-level cache of the machine measured is 32 MB; a smaller output may still be in cache when
// the next pass reads it.
bool worth_streaming(int64_t bytes) {
  return streaming_allowed().load(std::memory_order_relaxed) && bytes >= (int64_t{16} << 20);
}

namespace {

typedef float floats8 __attribute__((vector_size(32)));
constexpr int kLanes = 8;
constexpr int kBlock = 4;  // rows of q_t multiplied per pass over a row of x

inline floats8 load8(const float* p) {
  floats8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, floats8 v) { std::memcpy(p, &v, sizeof(v)); }

// A store of a row no one reads again soon (x before the second pass, the mean DDP copies out): on x86 a
// non-temporal store where the address allows it, which skips reading the line into the cache first (the
// rows are larger than the caches). The value stored is the same either way; fence() ends the kernel's
// work on each thread. Kernels decide once per call whether to stream (streaming_allowed, and the matrix
// too large to stay in cache).
inline void stream8(float* p, floats8 v) {
#if defined(__SSE2__)
  if ((reinterpret_cast<std::uintptr_t>(p) & 15) == 0) {
    __m128 lo, hi;
    std::memcpy(&lo, &v, sizeof(lo));
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
    _mm_stream_ps(p, lo);
    _mm_stream_ps(p + 4, hi);
    return;
  }
#endif
  store8(p, v);
}

inline void fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

inline float fold8(floats8 v) {
  // ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)): fixed
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

struct ProjectJob {
  float* p;            // n x r, row stride p_stride
  float* x;            // n x m, row stride x_stride
  const float* q_t;    // r x m, row stride q_stride
  const float* grad;   // n x m or null (then x is only read)
  const float* resid;  // n x m or null
  int64_t m, r, x_stride, p_stride, q_stride, g_stride, e_stride;
  bool stream;  // x's rows are stored non-temporally (set by the op; never when a later block reads them)
};

template <int B>
inline void project_block(const ProjectJob& job, int64_t i, int64_t k0, bool form) {
  float* xr = job.x + i * job.x_stride;
  const float* gr = form ? job.grad + i * job.g_stride : nullptr;
  const float* er = (form && job.resid) ? job.resid + i * job.e_stride : nullptr;
  const float* q[B];
  for (int b = 0; b < B; ++b) q[b] = job.q_t + (k0 + b) * job.q_stride;
  floats8 acc[B];
  for (int b = 0; b < B; ++b) acc[b] = floats8{};
  const int64_t main = job.m - job.m % kLanes;
  for (int64_t j = 0; j < main; j += kLanes) {
    floats8 v;
    if (form) {
      v = load8(gr + j);
      if (er) v += load8(er + j);
      if (job.stream) {
        stream8(xr + j, v);
      } else {
        store8(xr + j, v);
      }
    } else {
      v = load8(xr + j);
    }
    for (int b = 0; b < B; ++b) acc[b] += v * load8(q[b] + j);
  }
  float tail[B];
  for (int b = 0; b < B; ++b) tail[b] = 0.0f;
  for (int64_t j = main; j < job.m; ++j) {
    float v;
    if (form) {
      v = er ? gr[j] + er[j] : gr[j];
      xr[j] = v;
    } else {
      v = xr[j];
    }
    for (int b = 0; b < B; ++b) tail[b] += v * q[b][j];
  }
  for (int b = 0; b < B; ++b) job.p[i * job.p_stride + k0 + b] = fold8(acc[b]) + tail[b];
}

void project_rows(const ProjectJob& job, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    bool form = job.grad != nullptr;  // the first block forms the row of x, the later ones read it
    int64_t k = 0;
    for (; k + kBlock <= job.r; k += kBlock, form = false) project_block<kBlock>(job, i, k, form);
    for (; k < job.r; ++k, form = false) project_block<1>(job, i, k, form);
    if (form) {  // r == 0: x is still formed
      const float* gr = job.grad + i * job.g_stride;
      const float* er = job.resid ? job.resid + i * job.e_stride : nullptr;
      float* xr = job.x + i * job.x_stride;
      for (int64_t j = 0; j < job.m; ++j) xr[j] = er ? gr[j] + er[j] : gr[j];
    }
  }
}

#if FASTCOMM_HAVE_AVX2
FASTCOMM_AVX2 void project_rows_avx2(const ProjectJob& job, int64_t lo, int64_t hi) { project_rows(job, lo, hi); }
#endif

struct ExpandJob {
  float* mean;         // n x m, row stride mean_stride
  float* resid;        // n x m or null
  const float* p;      // n x r
  const float* q_t;    // r x m
  int64_t m, r, mean_stride, e_stride, p_stride, q_stride;
  bool stream;  // the mean's rows are stored non-temporally (set by the op)
};

// One 8-float chunk of a row of p q_t: a = (((0 + p_0 q_0) + p_1 q_1) + ...), k in order.
inline floats8 expand8(const ExpandJob& job, const float* pr, int64_t j) {
  floats8 a = floats8{};
  for (int64_t k = 0; k < job.r; ++k) a += pr[k] * load8(job.q_t + k * job.q_stride + j);
  return a;
}

inline void put8(const ExpandJob& job, float* out, float* er, int64_t j, floats8 a) {
  if (job.stream) {
    stream8(out + j, a);
  } else {
    store8(out + j, a);
  }
  if (er) store8(er + j, load8(er + j) - a);
}

void expand_rows(const ExpandJob& job, int64_t lo, int64_t hi) {
  constexpr int64_t kUnroll = 4;  // independent chunks in flight: each one's k-sum is a chain of adds
  const int64_t main = job.m - job.m % kLanes;
  const int64_t unrolled = job.m - job.m % (kLanes * kUnroll);
  for (int64_t i = lo; i < hi; ++i) {
    const float* pr = job.p + i * job.p_stride;
    float* out = job.mean + i * job.mean_stride;
    float* er = job.resid ? job.resid + i * job.e_stride : nullptr;
    int64_t j = 0;
    for (; j < unrolled; j += kLanes * kUnroll) {
      floats8 a[kUnroll];
      for (int64_t u = 0; u < kUnroll; ++u) a[u] = floats8{};
      for (int64_t k = 0; k < job.r; ++k) {
        const float c = pr[k];
        const float* q = job.q_t + k * job.q_stride + j;
        for (int64_t u = 0; u < kUnroll; ++u) a[u] += c * load8(q + u * kLanes);
      }
      for (int64_t u = 0; u < kUnroll; ++u) put8(job, out, er, j + u * kLanes, a[u]);
    }
    for (; j < main; j += kLanes) put8(job, out, er, j, expand8(job, pr, j));
    for (; j < job.m; ++j) {
      float a = 0.0f;
      for (int64_t k = 0; k < job.r; ++k) a += pr[k] * job.q_t[k * job.q_stride + j];
      out[j] = a;
      if (er) er[j] = er[j] - a;
    }
  }
}

#if FASTCOMM_HAVE_AVX2
FASTCOMM_AVX2 void expand_rows_avx2(const ExpandJob& job, int64_t lo, int64_t hi) { expand_rows(job, lo, hi); }
#endif

struct BackJob {
  float* q_t;        // r x m, written
  const float* p;    // n x r
  const float* x;    // n x m
  int64_t n, m, r, q_stride, p_stride, x_stride;
};

constexpr int64_t kTile = 1024;  // columns of q_t per tile: r rows of 4 KB, kept in L1/L2 while x streams by
constexpr int kRows = 4;         // rows of x added per load and store of q_t

// Columns [j0, j1) of q_t = p^T x: q_t[k, j] = (((0 + p[0,k] x[0,j]) + p[1,k] x[1,j]) + ...), rows in order.
template <int R>
inline void back_rows(const BackJob& job, int64_t i, int64_t j0, int64_t j1) {
  const float* xr[R];
  for (int ii = 0; ii < R; ++ii) xr[ii] = job.x + (i + ii) * job.x_stride;
  const float* pr = job.p + i * job.p_stride;
  const int64_t main = j0 + (j1 - j0) - (j1 - j0) % kLanes;
  for (int64_t j = j0; j < main; j += kLanes) {
    floats8 xv[R];
    for (int ii = 0; ii < R; ++ii) xv[ii] = load8(xr[ii] + j);
    for (int64_t k = 0; k < job.r; ++k) {
      float* q = job.q_t + k * job.q_stride + j;
      floats8 acc = load8(q);
      for (int ii = 0; ii < R; ++ii) acc += pr[ii * job.p_stride + k] * xv[ii];
      store8(q, acc);
    }
  }
  for (int64_t j = main; j < j1; ++j) {
    for (int64_t k = 0; k < job.r; ++k) {
      float acc = job.q_t[k * job.q_stride + j];
      for (int ii = 0; ii < R; ++ii) acc += pr[ii * job.p_stride + k] * xr[ii][j];
      job.q_t[k * job.q_stride + j] = acc;
    }
  }
}

void back_tiles(const BackJob& job, int64_t t_lo, int64_t t_hi) {
  for (int64_t t = t_lo; t < t_hi; ++t) {
    const int64_t j0 = t * kTile, j1 = std::min(job.m, j0 + kTile);
    for (int64_t k = 0; k < job.r; ++k) {
      float* q = job.q_t + k * job.q_stride;
      std::fill(q + j0, q + j1, 0.0f);
    }
    int64_t i = 0;
    for (; i + kRows <= job.n; i += kRows) back_rows<kRows>(job, i, j0, j1);
    for (; i < job.n; ++i) back_rows<1>(job, i, j0, j1);
  }
}

#if FASTCOMM_HAVE_AVX2
FASTCOMM_AVX2 void back_tiles_avx2(const BackJob& job, int64_t t_lo, int64_t t_hi) { back_tiles(job, t_lo, t_hi); }
#endif

void check_matrix(const char* op, const char* name, const at::Tensor& t, int64_t rows, int64_t cols) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, op, ": ", name, " must be ",
                    rows, " x ", cols, ", got ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(cols == 0 || t.stride(1) == 1, op, ": ", name, " must have contiguous rows");
}

int64_t row_stride(const at::Tensor& t) { return t.size(0) > 1 ? t.stride(0) : t.size(1); }

bool worth_streaming(int64_t n, int64_t m) { return fastcomm::worth_streaming(n * m * 4); }

int64_t grain(int64_t m, int64_t r) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, m * (r + 1))); }

struct Dims {
  int64_t n, m, r;
};

// The shapes of `matrix` (n x m), q_t (r x m) and p (n x r), checked; refusals name the op and argument.
Dims factor_dims(const char* op, const char* name, const at::Tensor& matrix, const at::Tensor& q_t,
                 const at::Tensor& p) {
  TORCH_CHECK_VALUE(matrix.dim() == 2, op, ": ", name, " must be 2-D (n x m), got ", matrix.sizes());
  TORCH_CHECK_VALUE(q_t.dim() == 2, op, ": q_t must be 2-D (r x m), got ", q_t.sizes());
  const Dims d{matrix.size(0), matrix.size(1), q_t.size(0)};
  check_matrix(op, name, matrix, d.n, d.m);
  check_matrix(op, "q_t", q_t, d.r, d.m);
  check_matrix(op, "p", p, d.n, d.r);
  return d;
}

template <typename Job>
using RowsFn = void (*)(const Job&, int64_t, int64_t);

// rows(job, lo, hi) over [0, count) in parallel, the AVX2 copy where it runs; each thread fences what it
// streamed before the op returns.
template <typename Job>
void run_parallel(int64_t count, int64_t grain_size, const Job& job, RowsFn<Job> rows, RowsFn<Job> rows_avx2) {
  const RowsFn<Job> fn = use_avx2() && rows_avx2 != nullptr ? rows_avx2 : rows;
  at::parallel_for(0, count, grain_size, [&](int64_t lo, int64_t hi) {
    fn(job, lo, hi);
    fence();
  });
}

#if FASTCOMM_HAVE_AVX2
#define FASTCOMM_AVX2_COPY(fn) (&fn)
#else
#define FASTCOMM_AVX2_COPY(fn) nullptr
#endif

}  // namespace

void powersgd_project_cpu(const at::Tensor& p, const at::Tensor& x, const at::Tensor& q_t,
                          const std::optional<at::Tensor>& gradient, const std::optional<at::Tensor>& residual) {
  const char* op = "powersgd_project";
  const Dims d = factor_dims(op, "x", x, q_t, p);
  TORCH_CHECK_VALUE(gradient.has_value() || !residual.has_value(), op, ": residual needs gradient");
  ProjectJob job{p.data_ptr<float>(), x.data_ptr<float>(), q_t.const_data_ptr<float>(), nullptr, nullptr,
                 d.m, d.r, row_stride(x), d.r > 0 ? row_stride(p) : 0, row_stride(q_t), 0, 0,
                 worth_streaming(d.n, d.m) && d.r <= kBlock};  // more blocks read the rows back
  if (gradient.has_value()) {
    check_matrix(op, "gradient", *gradient, d.n, d.m);
    job.grad = gradient->const_data_ptr<float>();
    job.g_stride = row_stride(*gradient);
  }
  if (residual.has_value()) {
    check_matrix(op, "residual", *residual, d.n, d.m);
    job.resid = residual->const_data_ptr<float>();
    job.e_stride = row_stride(*residual);
  }
  run_parallel<ProjectJob>(d.n, grain(d.m, d.r), job, &project_rows, FASTCOMM_AVX2_COPY(project_rows_avx2));
}

void powersgd_expand_cpu(const at::Tensor& mean, const at::Tensor& p, const at::Tensor& q_t,
                         const std::optional<at::Tensor>& residual) {
  const char* op = "powersgd_expand";
  const Dims d = factor_dims(op, "mean", mean, q_t, p);
  ExpandJob job{mean.data_ptr<float>(), nullptr, p.const_data_ptr<float>(), q_t.const_data_ptr<float>(),
                d.m, d.r, row_stride(mean), 0, d.r > 0 ? row_stride(p) : 0, row_stride(q_t),
                worth_streaming(d.n, d.m)};
  if (residual.has_value()) {
    check_matrix(op, "residual", *residual, d.n, d.m);
    job.resid = residual->data_ptr<float>();
    job.e_stride = row_stride(*residual);
  }
  run_parallel<ExpandJob>(d.n, grain(d.m, d.r), job, &expand_rows, FASTCOMM_AVX2_COPY(expand_rows_avx2));
}

void powersgd_back_project_cpu(const at::Tensor& q_t, const at::Tensor& p, const at::Tensor& x) {
  const Dims d = factor_dims("powersgd_back_project", "x", x, q_t, p);
  if (d.r == 0 || d.m == 0) return;
  BackJob job{q_t.data_ptr<float>(), p.const_data_ptr<float>(), x.const_data_ptr<float>(),
              d.n, d.m, d.r, row_stride(q_t), row_stride(p), row_stride(x)};
  run_parallel<BackJob>(ceil_div(d.m, kTile), 1, job, &back_tiles, FASTCOMM_AVX2_COPY(back_tiles_avx2));
}

}  // namespace fastcomm
