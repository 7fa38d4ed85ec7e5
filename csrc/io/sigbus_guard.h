// Reads of a memory-mapped file that survive the file shrinking under the mapping.
//
// A page of a mapping past the file's current end faults with SIGBUS, which kills the process by default. A
// guarded loop instead stops at the faulting item and returns its index: a process-wide SIGBUS handler jumps
// back to the loop whose thread took the fault (a thread-local sigjmp_buf); a SIGBUS on a thread that is not
// inside a guarded loop goes to the handler that was installed before ours (or kills the process as usual).
#pragma once

#include <csetjmp>
#include <cstdint>

namespace fastio {

// Installs the handler, or puts it back if someone replaced it since (Python's faulthandler does); cheap.
void ensure_sigbus_handler();

// The slot the handler jumps through for the calling thread (null outside a guarded loop).
sigjmp_buf*& sigbus_guard_slot();

// After a jump out of the handler: SIGBUS is blocked while a handler runs, a jump does not unblock it.
void unblock_sigbus();

// Calls fn(i) for i in [begin, end) on this thread; returns -1, or the i during which SIGBUS arrived (then
// fn(i) stopped partway and later items were not run). Call ensure_sigbus_handler() first.
template <class Fn>
int64_t guarded_for(int64_t begin, int64_t end, Fn&& fn) {
  sigjmp_buf jump;
  sigjmp_buf*& slot = sigbus_guard_slot();
  sigjmp_buf* const previous = slot;
  volatile int64_t i = begin;  // read after the jump: must live in memory, not a register
  if (sigsetjmp(jump, 0) != 0) {
    slot = previous;
    unblock_sigbus();
    return i;
  }
  slot = &jump;
  while (i < end) {
    fn(static_cast<int64_t>(i));
    i = i + 1;
  }
  slot = previous;
  return -1;
}

}  // namespace fastio
