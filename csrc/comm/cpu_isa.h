// Runtime choice between a baseline build of a hot loop and an AVX2 build of the same source.
//
// The extension is compiled for baseline x86-64 (SSE2), where the 32-bit multiplies of the stochastic
// rounding hash (pmulld) and variable shifts do not exist, so those loops stay scalar. A function marked
// FASTCOMM_AVX2 is compiled a second time for AVX2 (flatten inlines everything it calls into that copy), and
// callers pick it once per call with use_avx2(). Only AVX2 is enabled, not FMA, and the build passes
// -ffp-contract=off, so both copies perform the same IEEE fp32 operations and give the same bits; loops
// whose result depends on the reduction order (fp64 sums) are kept out of the AVX2 copies.
#pragma once

#include <atomic>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define FASTCOMM_HAVE_AVX2 1
#define FASTCOMM_AVX2 __attribute__((target("avx2"), flatten))
#else
#define FASTCOMM_HAVE_AVX2 0
#define FASTCOMM_AVX2
#endif

namespace fastcomm {

// Cleared by tests to run the baseline copies on an AVX2 machine (fastcomm._C._set_avx2(False)).
inline std::atomic<bool>& avx2_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

inline bool cpu_has_avx2() {
#if FASTCOMM_HAVE_AVX2
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
#else
  return false;
#endif
}

inline bool use_avx2() { return cpu_has_avx2() && avx2_allowed().load(std::memory_order_relaxed); }

}  // namespace fastcomm
