// The SIGBUS handler of fault_guard.h and the table of guarded threads it reads.
//
// The handler may only do what is async-signal-safe: it reads lock-free atomics and calls
// pthread_self (a read of the thread pointer in glibc and macOS), sigaction, raise and siglongjmp.
// The guarded threads are found in a fixed table keyed by pthread_self, not in thread_local
// storage: a library loaded with dlopen gets its thread_local blocks lazily, with malloc, on a
// thread's first touch, which a handler must not risk (a fault inside malloc would deadlock).

#include "fault_guard.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <functional>

namespace i4p {
namespace fault {

struct Slot {
  std::atomic<pthread_t> owner;   // the thread, or pthread_t{} for a free slot
  std::atomic<sigjmp_buf*> env;   // its innermost guard
  std::atomic<uintptr_t> address; // where its last fault was
};

namespace {

static_assert(std::atomic<pthread_t>::is_always_lock_free && std::atomic<sigjmp_buf*>::is_always_lock_free &&
                  std::atomic<uintptr_t>::is_always_lock_free,
              "the signal handler reads these: they must be lock-free");

// guarded threads at once: convert's workers times their kernel threads, verify's threads; a
// thread beyond these runs its region unguarded (a vanished source then ends the process, as
// without the guard)
constexpr int kSlots = 512;
static_assert(kSlots == 1 << 9, "a Guard's first slot is 9 bits of its thread's id");
Slot g_slots[kSlots];
struct sigaction g_previous;  // the SIGBUS action before ours: where an unguarded fault goes

// this thread's slot while it holds one: what a Guard looks at first, outside the handler only
thread_local Slot* t_slot = nullptr;

// the handler's way to this thread's slot
Slot* slot_of(pthread_t self) {
  for (Slot& s : g_slots)
    if (s.owner.load(std::memory_order_relaxed) == self) return &s;
  return nullptr;
}

// SIGBUS not ours to take: the previous handler, else the default action
void chain(int sig, siginfo_t* info, void* context) {
  const bool raised_by_access = info != nullptr && info->si_code > 0;
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) {
      g_previous.sa_sigaction(sig, info, context);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
    return;
  }
  if (g_previous.sa_handler == SIG_IGN && !raised_by_access) return;  // a sent SIGBUS the process ignores
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
  // a fault: returning runs the access again, which now takes the default action (the process
  // ends with SIGBUS, its core at the access); a sent signal is sent again
  if (!raised_by_access) raise(sig);
}

void on_sigbus(int sig, siginfo_t* info, void* context) {
  if (info != nullptr && info->si_code > 0) {  // raised by an access (BUS_ADRERR, ...), not sent by kill()
    Slot* s = slot_of(pthread_self());
    sigjmp_buf* env = s != nullptr ? s->env.load(std::memory_order_relaxed) : nullptr;
    if (env != nullptr) {
      s->address.store(reinterpret_cast<uintptr_t>(info->si_addr), std::memory_order_relaxed);
      siglongjmp(*env, 1);
    }
  }
  chain(sig, info, context);
}

// a forked child has only the forking thread: the others' slots would be taken by threads that
// happen to get their pthread_t values
void forget_all() {
  for (Slot& s : g_slots) {
    s.env.store(nullptr, std::memory_order_relaxed);
    s.owner.store(pthread_t{}, std::memory_order_relaxed);
  }
}

struct Install {
  Install() {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    // NODEFER: SIGBUS stays unblocked in the handler, so the jump (which keeps the mask) leaves it
    // unblocked; ONSTACK: on the thread's alternate stack where it has one, as faulthandler's
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previous);
    pthread_atfork(nullptr, nullptr, forget_all);
  }
} g_install;  // when the library is loaded, once per process

}  // namespace

Guard::Guard(sigjmp_buf* env) : slot_(nullptr), outer_(nullptr) {
  const pthread_t self = pthread_self();
  Slot* s = t_slot != nullptr && t_slot->owner.load(std::memory_order_relaxed) == self ? t_slot : nullptr;
  // a free slot, looked for from a place of this thread's own (its id's bits mixed: thread ids are
  // aligned addresses), so that threads starting together rarely meet
  const uint64_t mixed = static_cast<uint64_t>(std::hash<pthread_t>()(self)) * 0x9E3779B97F4A7C15ull;
  const int start = static_cast<int>(mixed >> 55);  // kSlots = 2^9
  for (int i = 0; s == nullptr && i < kSlots; ++i) {
    Slot& c = g_slots[(start + i) % kSlots];
    pthread_t free_slot{};
    if (c.owner.compare_exchange_strong(free_slot, self)) s = &c;
  }
  if (s == nullptr) return;
  t_slot = s;
  outer_ = s->env.load(std::memory_order_relaxed);
  s->address.store(0, std::memory_order_relaxed);
  s->env.store(env, std::memory_order_relaxed);
  std::atomic_signal_fence(std::memory_order_seq_cst);  // set before the guarded code runs
  slot_ = s;
}

Guard::~Guard() {
  if (slot_ == nullptr) return;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  slot_->env.store(outer_, std::memory_order_relaxed);
  if (outer_ == nullptr) {
    t_slot = nullptr;
    slot_->owner.store(pthread_t{}, std::memory_order_release);
  }
}

uintptr_t Guard::address() const {
  return slot_ != nullptr ? slot_->address.load(std::memory_order_relaxed) : 0;
}

void unblock() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGBUS);
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

}  // namespace fault
}  // namespace i4p
