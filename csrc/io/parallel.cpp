// See parallel.h.
#include "io/parallel.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace fastio {

namespace {

struct Job {
  std::function<void(int64_t, int64_t)> fn;
  int64_t n = 0;
  int64_t chunk = 1;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<int> helpers_wanted{0};
  std::mutex mutex;
  std::condition_variable finished;

  void work() {
    while (true) {
      const int64_t begin = next.fetch_add(chunk);
      if (begin >= n) return;
      const int64_t end = std::min(begin + chunk, n);
      fn(begin, end);
      if (done.fetch_add(end - begin) + (end - begin) == n) {
        std::lock_guard<std::mutex> lock(mutex);
        finished.notify_all();
      }
    }
  }
};

class Pool {
 public:
  void run(const std::shared_ptr<Job>& job, int helpers) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int>(threads_) < helpers && threads_ < 64) {
        std::thread(&Pool::helper, this).detach();  // the pool lives until exit: never joined
        ++threads_;
      }
      job->helpers_wanted = helpers;
      queue_.push_back(job);
    }
    wake_.notify_all();
    job->work();
    {
      std::unique_lock<std::mutex> lock(job->mutex);
      job->finished.wait(lock, [&] { return job->done.load() == job->n; });
    }
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.erase(std::remove(queue_.begin(), queue_.end(), job), queue_.end());
  }

 private:
  // Under mutex_: take a share of a job that still has chunks left and wants helpers.
  std::shared_ptr<Job> claim() {
    for (auto& j : queue_) {
      if (j->helpers_wanted > 0 && j->next.load() < j->n) {
        --j->helpers_wanted;
        return j;
      }
    }
    return nullptr;
  }

  void helper() {
    while (true) {
      std::shared_ptr<Job> job;
      {
        // Claimed inside the wait's predicate, so what woke the helper is what it works on. The job may be
        // used up by the time work() runs (the caller takes chunks too, without the lock): work() then
        // returns at once.
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return (job = claim()) != nullptr; });
      }
      job->work();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> queue_;
  size_t threads_ = 0;
};

Pool* g_pool = nullptr;
std::once_flag g_once;

// A forked child has none of the parent's helper threads (and maybe a lock held by one): start afresh.
void reset_after_fork() { g_pool = new Pool(); }

Pool& pool() {
  std::call_once(g_once, [] {
    g_pool = new Pool();
    pthread_atfork(nullptr, nullptr, reset_after_fork);
  });
  return *g_pool;
}

}  // namespace

void parallel_chunks(int64_t n, int64_t chunk, int threads, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(chunk, 1);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int helpers = static_cast<int>(std::min<int64_t>(threads - 1, chunks - 1));
  if (helpers <= 0) {
    fn(0, n);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = fn;
  job->n = n;
  job->chunk = chunk;
  pool().run(job, helpers);
}

}  // namespace fastio
