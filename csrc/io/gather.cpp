// Batch gather from memory-mapped shards into a caller-owned output buffer.
//
// The Python side (fastio/_native.py) hands in the base address and mapped length of every shard it has open,
// plus, per sample of the batch, which shard and which byte offset to read. Every range is checked against its
// shard's mapped length before any byte is copied, so a bad plan raises instead of reading past a mapping. The
// copies run under a SIGBUS guard (sigbus_guard.h): a file truncated while mapped makes the gather return the
// faulting sample instead of killing the process.
#include "io/gather.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

#include "io/parallel.h"
#include "io/sigbus_guard.h"

namespace fastio {

namespace {

void check_ranges(const int64_t* limits, int64_t num_shards, const int32_t* shard_ids, const int64_t* offsets,
                  const int64_t* lengths, int64_t row_nbytes, int64_t batch) {
  for (int64_t i = 0; i < batch; ++i) {
    const int32_t s = shard_ids[i];
    const int64_t n = lengths ? lengths[i] : row_nbytes;
    if (s < 0 || s >= num_shards) {
      throw std::out_of_range("fastio gather: sample " + std::to_string(i) + " names shard " + std::to_string(s) +
                              " of " + std::to_string(num_shards));
    }
    if (offsets[i] < 0 || n < 0 || offsets[i] + n > limits[s]) {
      throw std::out_of_range("fastio gather: sample " + std::to_string(i) + " reads bytes [" +
                              std::to_string(offsets[i]) + ", " + std::to_string(offsets[i] + n) + ") of shard " +
                              std::to_string(s) + " which maps only " + std::to_string(limits[s]) + " bytes");
    }
  }
}

constexpr int64_t kChunkBytes = int64_t{1} << 17;  // 128 KiB of copying per chunk a thread takes

int pick_threads(int requested, int64_t total_bytes) {
  // Below two chunks, handing work to a helper costs more than the copy.
  if (requested <= 1 || total_bytes < 2 * kChunkBytes) return 1;
  return requested;
}

// The smallest faulting sample seen by any thread (-1: none).
void record_fault(std::atomic<int64_t>& fault, int64_t sample) {
  if (sample < 0) return;
  int64_t seen = fault.load();
  while ((seen < 0 || sample < seen) && !fault.compare_exchange_weak(seen, sample)) {
  }
}

}  // namespace

int64_t gather_rows(const int64_t* bases, const int64_t* limits, int64_t num_shards, const int32_t* shard_ids,
                 const int64_t* offsets, int64_t batch, int64_t row_nbytes, uint8_t* out, int64_t out_nbytes,
                 int num_threads) {
  if (batch * row_nbytes > out_nbytes) {
    throw std::length_error("fastio gather_rows: output holds " + std::to_string(out_nbytes) + " bytes, batch needs " +
                            std::to_string(batch * row_nbytes));
  }
  check_ranges(limits, num_shards, shard_ids, offsets, nullptr, row_nbytes, batch);
  const int threads = pick_threads(num_threads, batch * row_nbytes);
  const int64_t rows_per_chunk = std::max<int64_t>(1, kChunkBytes / std::max<int64_t>(row_nbytes, 1));
  ensure_sigbus_handler();
  std::atomic<int64_t> fault{-1};
  parallel_chunks(batch, rows_per_chunk, threads, [&](int64_t begin, int64_t end) {
    record_fault(fault, guarded_for(begin, end, [&](int64_t i) {
                   const auto* src = reinterpret_cast<const uint8_t*>(bases[shard_ids[i]]) + offsets[i];
                   std::memcpy(out + i * row_nbytes, src, static_cast<size_t>(row_nbytes));
                 }));
  });
  return fault.load();
}

int64_t gather_ranges(const int64_t* bases, const int64_t* limits, int64_t num_shards, const int32_t* shard_ids,
                   const int64_t* offsets, const int64_t* lengths, const int64_t* dst_offsets, int64_t batch,
                   uint8_t* out, int64_t out_nbytes, int num_threads) {
  check_ranges(limits, num_shards, shard_ids, offsets, lengths, 0, batch);
  int64_t total = 0;
  for (int64_t i = 0; i < batch; ++i) {
    if (dst_offsets[i] < 0 || dst_offsets[i] + lengths[i] > out_nbytes) {
      throw std::length_error("fastio gather_ranges: sample " + std::to_string(i) + " writes past the " +
                              std::to_string(out_nbytes) + "-byte output");
    }
    total += lengths[i];
  }
  const int threads = pick_threads(num_threads, total);
  const int64_t items_per_chunk = std::max<int64_t>(1, kChunkBytes * batch / std::max<int64_t>(total, 1));
  ensure_sigbus_handler();
  std::atomic<int64_t> fault{-1};
  parallel_chunks(batch, items_per_chunk, threads, [&](int64_t begin, int64_t end) {
    record_fault(fault, guarded_for(begin, end, [&](int64_t i) {
                   const auto* src = reinterpret_cast<const uint8_t*>(bases[shard_ids[i]]) + offsets[i];
                   std::memcpy(out + dst_offsets[i], src, static_cast<size_t>(lengths[i]));
                 }));
  });
  return fault.load();
}

}  // namespace fastio
