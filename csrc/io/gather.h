// Kernels of fastio._C; bindings live in module.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fastio {

// out[i * row_nbytes : (i + 1) * row_nbytes] = shard[shard_ids[i]][offsets[i] : offsets[i] + row_nbytes]
void gather_rows(const int64_t* bases, const int64_t* limits, int64_t num_shards, const int32_t* shard_ids,
                 const int64_t* offsets, int64_t batch, int64_t row_nbytes, uint8_t* out, int64_t out_nbytes,
                 int num_threads);

// out[dst_offsets[i] : dst_offsets[i] + lengths[i]] = shard[shard_ids[i]][offsets[i] : offsets[i] + lengths[i]]
void gather_ranges(const int64_t* bases, const int64_t* limits, int64_t num_shards, const int32_t* shard_ids,
                   const int64_t* offsets, const int64_t* lengths, const int64_t* dst_offsets, int64_t batch,
                   uint8_t* out, int64_t out_nbytes, int num_threads);

struct TarMember {
  std::string name;
  int64_t offset;  // of the member's data, from the start of the archive
  int64_t size;
};

// Every regular file of a ustar/GNU/pax tar archive, in archive order. Throws std::runtime_error naming the
// archive and the byte position on a bad header checksum or a member that runs past the end of the file.
std::vector<TarMember> scan_tar(const std::string& path);

}  // namespace fastio
