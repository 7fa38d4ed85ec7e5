// See sigbus_guard.h.
#include "io/sigbus_guard.h"

#include <signal.h>

#include <mutex>

namespace fastio {

namespace {

thread_local sigjmp_buf* t_guard = nullptr;
struct sigaction g_previous {};
std::mutex g_install_mutex;

void on_sigbus(int sig, siginfo_t* info, void* context) {
  if (t_guard != nullptr) siglongjmp(*t_guard, 1);
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler == SIG_DFL || g_previous.sa_handler == SIG_IGN) {
    // Not ours, and nobody else's: die of it as the process would have (an ignored fault would repeat).
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  g_previous.sa_handler(sig);
}

bool ours(const struct sigaction& action) {
  return (action.sa_flags & SA_SIGINFO) && action.sa_sigaction == &on_sigbus;
}

}  // namespace

void ensure_sigbus_handler() {
  struct sigaction current {};
  sigaction(SIGBUS, nullptr, &current);
  if (ours(current)) return;
  std::lock_guard<std::mutex> lock(g_install_mutex);
  struct sigaction action {};
  action.sa_sigaction = &on_sigbus;
  action.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  struct sigaction replaced {};
  if (sigaction(SIGBUS, &action, &replaced) == 0 && !ours(replaced)) g_previous = replaced;
}

sigjmp_buf*& sigbus_guard_slot() { return t_guard; }

void unblock_sigbus() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGBUS);
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

}  // namespace fastio
