// A small persistent thread pool for the gather kernels, robust on a busy machine.
//
// Why not an OpenMP team: on a machine whose cores are shared, a team's barrier waits for every thread to be
// scheduled, so one preempted thread stalls a 50 us copy for a whole time slice (measured: 40x slower batches).
// Here the calling thread works through the chunks itself and helpers join only if they get a core: a helper
// that never runs costs nothing, one that is preempted delays the call by at most one chunk.
#pragma once

#include <cstdint>
#include <functional>

namespace fastio {

// Calls fn(begin, end) over [0, n) in chunks of `chunk`, on the calling thread plus up to threads - 1 helpers.
void parallel_chunks(int64_t n, int64_t chunk, int threads, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace fastio
