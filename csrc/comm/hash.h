// The counter-based hash shared by the CPU and CUDA kernels (reference._hash32 / uniform_hash).
// Torch-free, so the CUDA kernel header can include it and be compiled on its own.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FASTCOMM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FASTCOMM_HOST_DEVICE inline
#endif

namespace fastcomm {

// MurmurHash3's 32-bit finaliser.
FASTCOMM_HOST_DEVICE uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// reference._hash32's seed folding: (seed ^ (seed >> 32)) & 0xFFFFFFFF.
FASTCOMM_HOST_DEVICE uint32_t seed32(int64_t seed) { return static_cast<uint32_t>(seed ^ (seed >> 32)); }

// fmix32((index * golden) mod 2^32 XOR seed32).
FASTCOMM_HOST_DEVICE uint32_t hash32(uint64_t index, uint32_t seed) {
  return fmix32((static_cast<uint32_t>(index) * 0x9E3779B1u) ^ seed);
}

// reference.uniform_hash: the top 24 bits of the hash as a float in [0, 1). h >> 8 < 2^24 converts exactly
// through int32, which vectorizes on every x86 level (an unsigned conversion needs AVX-512).
FASTCOMM_HOST_DEVICE float uniform_from_hash(uint32_t h) {
  return static_cast<float>(static_cast<int32_t>(h >> 8)) * 5.9604644775390625e-08f;
}

}  // namespace fastcomm
