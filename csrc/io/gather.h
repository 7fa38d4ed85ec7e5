// Kernels of fastio._C; bindings live in module.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fastio {

// Both gathers return -1, or the first sample whose source page faulted with SIGBUS (its file shrank under
// the mapping): the copy of that sample stopped there and the caller must not use the output.

// out[i * row_nbytes : (i + 1) * row_nbytes] = shard[shard_ids[i]][offsets[i] : offsets[i] + row_nbytes]
int64_t gather_rows(const int64_t* bases, const int64_t* limits, int64_t num_shards, const int32_t* shard_ids,
                 const int64_t* offsets, int64_t batch, int64_t row_nbytes, uint8_t* out, int64_t out_nbytes,
                 int num_threads);

// out[dst_offsets[i] : dst_offsets[i] + lengths[i]] = shard[shard_ids[i]][offsets[i] : offsets[i] + lengths[i]]
int64_t gather_ranges(const int64_t* bases, const int64_t* limits, int64_t num_shards, const int32_t* shard_ids,
                   const int64_t* offsets, const int64_t* lengths, const int64_t* dst_offsets, int64_t batch,
                   uint8_t* out, int64_t out_nbytes, int num_threads);

struct TarMember {
  std::string name;
  int64_t offset;  // of the member's data, from the start of the archive
  int64_t size;
};

struct TarScan {
  std::vector<TarMember> members;  // up to the end-of-archive marker (or the end of the file)
  std::string problem;             // empty, or what makes the archive unfit for the strict mode
};

// Every regular file of a ustar/GNU/pax tar archive, in archive order. Throws std::runtime_error saying what
// and at which byte on a malformed header (checksum, a numeric field, a pax record) or a member that runs past
// the end of the file. A zero block followed by more data, or no end-of-archive marker, lands in `problem`.
TarScan scan_tar(const std::string& path);

}  // namespace fastio
