// CUDA kernels of topk_select (see topk_cuda.cu for the algorithm and the torch glue).
//
// This header depends on the CUDA runtime only, not on torch, so the kernels can be compiled and checked on
// their own. scalar_t is any type with static_cast<float>(v) and static_cast<scalar_t>(float) on the device
// (float, double, c10::Half, c10::BFloat16, __half, __nv_bfloat16).
#pragma once

#include <cstdint>

#include "hash.h"

namespace fastcomm {
namespace topk_cuda {

constexpr int kThreads = 256;  // every kernel here runs 256-thread blocks (8 warps)
constexpr int kWarps = kThreads / 32;
constexpr int kRounds = 16;    // a selection tile is kRounds * kThreads consecutive elements
constexpr int64_t kTile = int64_t{kRounds} * kThreads;
constexpr int kBins = 2048;    // radix digits of at most 11 bits: levels 30..20, 19..9, 8..0 of the key
constexpr int kLevels = 3;
constexpr int kLevelShift[kLevels] = {20, 9, 0};
constexpr uint32_t kLevelDigitMask[kLevels] = {0x7FFu, 0x7FFu, 0x1FFu};
constexpr uint32_t kLevelPrefixMask[kLevels] = {0u, 0x7FF00000u, 0x7FFFFE00u};

// Order key of |v|: the bit pattern of fabs(float(v)) (NaN above +inf), as reference._magnitude_keys.
template <typename scalar_t>
__device__ __forceinline__ uint32_t magnitude_key(scalar_t v) {
  return __float_as_uint(static_cast<float>(v)) & 0x7FFFFFFFu;
}

// acc = x + source in scalar_t (one fp32 add rounded once), written to work. source is residual_source or
// work itself (the in-place form; each element is read before it is written), so neither is __restrict__.
template <typename scalar_t>
__global__ void accumulate_kernel(const scalar_t* __restrict__ x, const scalar_t* source, scalar_t* work,
                                  int64_t n) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    work[i] = static_cast<scalar_t>(static_cast<float>(x[i]) + static_cast<float>(source[i]));
  }
}

// Histogram of one radix digit over the keys whose higher digits equal the prefix found so far (state[0]).
template <typename scalar_t>
__global__ void digit_histogram_kernel(const scalar_t* __restrict__ acc, int64_t n, const int32_t* __restrict__ state,
                                       uint32_t prefix_mask, int shift, uint32_t digit_mask,
                                       unsigned int* __restrict__ hist) {
  __shared__ unsigned int local[kBins];
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  const uint32_t prefix = static_cast<uint32_t>(state[0]);
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t key = magnitude_key(acc[i]);
    if ((key & prefix_mask) == prefix) atomicAdd(&local[(key >> shift) & digit_mask], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) {
    if (local[b] != 0) atomicAdd(&hist[b], local[b]);
  }
}

// Exclusive prefix sum of one value per thread across a kThreads block.
__device__ __forceinline__ unsigned int block_exclusive_sum(unsigned int value, unsigned int* warp_totals) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  unsigned int inclusive = value;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const unsigned int other = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  unsigned int before = inclusive - value;
  for (int w = 0; w < warp; ++w) before += warp_totals[w];
  return before;
}

// One block: the digit (scanning from the largest) that holds the state[1]-th largest key among the keys
// counted in hist. Appends it to the prefix (state[0]) and leaves in state[1] the rank within that digit.
__global__ void find_digit_kernel(const unsigned int* __restrict__ hist, int shift, int32_t* __restrict__ state) {
  constexpr int kItems = kBins / kThreads;
  __shared__ unsigned int warp_totals[kWarps];
  const unsigned int remaining = static_cast<unsigned int>(state[1]);
  unsigned int counts[kItems];
  unsigned int sum = 0;
  for (int j = 0; j < kItems; ++j) {
    counts[j] = hist[kBins - 1 - (threadIdx.x * kItems + j)];
    sum += counts[j];
  }
  // block_exclusive_sum synchronises the block, so every thread has read state before it is written.
  unsigned int before = block_exclusive_sum(sum, warp_totals);
  for (int j = 0; j < kItems; ++j) {
    if (before < remaining && remaining <= before + counts[j]) {
      const uint32_t digit = kBins - 1 - (threadIdx.x * kItems + j);
      state[0] = static_cast<int32_t>(static_cast<uint32_t>(state[0]) | (digit << shift));
      state[1] = static_cast<int32_t>(remaining - before);
    }
    before += counts[j];
  }
}

// Magnitude keys of the stratified sample of reference._approx_threshold: one per stratum of `stride`.
template <typename scalar_t>
__global__ void sample_keys_kernel(const scalar_t* __restrict__ acc, int64_t m, int64_t stride,
                                   int32_t* __restrict__ keys) {
  for (int64_t s = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; s < m; s += int64_t{gridDim.x} * blockDim.x) {
    const int64_t position = s * stride + static_cast<int64_t>(hash32(static_cast<uint64_t>(s), 0u) % stride);
    keys[s] = static_cast<int32_t>(magnitude_key(acc[position]));
  }
}

// Per tile of kTile elements: how many keys lie above the threshold (state[0]) and how many equal it.
template <typename scalar_t>
__global__ void count_selected_kernel(const scalar_t* __restrict__ acc, int64_t n, const int32_t* __restrict__ state,
                                      int32_t* __restrict__ above_counts, int32_t* __restrict__ tie_counts) {
  const uint32_t threshold = static_cast<uint32_t>(state[0]);
  const int64_t tile_start = int64_t{blockIdx.x} * kTile;
  int above = 0;
  int ties = 0;
  for (int r = 0; r < kRounds; ++r) {
    const int64_t i = tile_start + int64_t{r} * kThreads + threadIdx.x;
    const uint32_t key = i < n ? magnitude_key(acc[i]) : 0u;
    above += __syncthreads_count(i < n && key > threshold);
    ties += __syncthreads_count(i < n && key == threshold);
  }
  if (threadIdx.x == 0) {
    above_counts[blockIdx.x] = above;
    tie_counts[blockIdx.x] = ties;
  }
}

// Writes the selected entries in ascending index order: every key above the threshold and the first
// state[1] keys equal to it. The output position of entry i is (keys above before i) + min(ties before i,
// state[1]); the tile offsets are exclusive prefix sums of count_selected_kernel's counts. Zeroes the
// selected entries of `residual` (the buffer acc lives in) when it is given.
template <typename scalar_t>
__global__ void write_selected_kernel(const scalar_t* acc, scalar_t* residual, int64_t n,
                                      const int32_t* __restrict__ state, const int32_t* __restrict__ above_offsets,
                                      const int32_t* __restrict__ tie_offsets, scalar_t* __restrict__ values,
                                      int32_t* __restrict__ indices) {
  __shared__ int warp_above[kWarps];
  __shared__ int warp_ties[kWarps];
  const uint32_t threshold = static_cast<uint32_t>(state[0]);
  const int ties_needed = state[1];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const unsigned int lanes_below = (1u << lane) - 1u;
  const int64_t tile_start = int64_t{blockIdx.x} * kTile;
  int above_base = above_offsets[blockIdx.x];
  int tie_base = tie_offsets[blockIdx.x];
  for (int r = 0; r < kRounds; ++r) {
    const int64_t round_start = tile_start + int64_t{r} * kThreads;
    if (round_start >= n) break;  // the same for the whole block, so no thread skips a barrier alone
    const int64_t i = round_start + threadIdx.x;
    const bool valid = i < n;
    const scalar_t v = valid ? acc[i] : static_cast<scalar_t>(0.0f);
    const uint32_t key = magnitude_key(v);
    const bool above = valid && key > threshold;
    const bool tie = valid && key == threshold;
    const unsigned int above_mask = __ballot_sync(0xFFFFFFFFu, above);
    const unsigned int tie_mask = __ballot_sync(0xFFFFFFFFu, tie);
    if (lane == 0) {
      warp_above[warp] = __popc(above_mask);
      warp_ties[warp] = __popc(tie_mask);
    }
    __syncthreads();
    int above_before = above_base + __popc(above_mask & lanes_below);
    int ties_before = tie_base + __popc(tie_mask & lanes_below);
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) {
        above_before += warp_above[w];
        ties_before += warp_ties[w];
      }
      above_base += warp_above[w];
      tie_base += warp_ties[w];
    }
    if (above || (tie && ties_before < ties_needed)) {
      const int position = above_before + min(ties_before, ties_needed);
      values[position] = v;
      indices[position] = static_cast<int32_t>(i);
      if (residual != nullptr) residual[i] = static_cast<scalar_t>(0.0f);
    }
    __syncthreads();  // warp_above/warp_ties are rewritten by the next round
  }
}

}  // namespace topk_cuda
}  // namespace fastcomm
