// Shared by every int4pack kernel: checks that become error messages, and the row splitter.
//
// The kernels build into one plain shared library (setup.py, at pip install time) with a C ABI
// (api.cpp): pointers and sizes in, a status out. No torch or Python headers, so one build serves
// every torch and every Python; int4pack/_native.py calls it through ctypes.
#pragma once

#include <cstdint>
#include <exception>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fault_guard.h"

#define I4P_EXPORT extern "C" __attribute__((visibility("default")))

namespace i4p {

template <class... A>
[[noreturn]] void fail(const A&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  throw std::invalid_argument(s.str());
}

// a failed check throws; api.cpp turns it into status -1 and i4p_last_error()
#define I4P_CHECK(cond, ...)      \
  do {                            \
    if (!(cond)) ::i4p::fail(__VA_ARGS__); \
  } while (0)

// f(r0, r1) over [0, n) in up to `threads` contiguous ranges of at least `grain` rows, each on its
// own thread (the caller's thread takes the first). Every kernel computes a row from its inputs
// alone and sums rows in order afterwards, so the split never changes a byte. Each thread's range
// runs guarded (fault_guard.h): source bytes that vanish under one end its range, and the call
// throws SourceFault once every thread is joined.
template <class F>
void for_rows(int64_t n, int64_t grain, int64_t threads, const F& f) {
  grain = grain < 1 ? 1 : grain;
  const int64_t most = (n + grain - 1) / grain;
  const int64_t parts = threads < most ? threads : most;
  if (parts <= 1) {
    f(int64_t{0}, n);
    return;
  }
  const int64_t step = (n + parts - 1) / parts;
  std::exception_ptr error;
  std::mutex m;
  auto run = [&](int64_t r0, int64_t r1) {
    try {
      const uintptr_t fault = run_guarded([&] { f(r0, r1); });
      if (fault != 0) throw SourceFault(fault);
    } catch (...) {
      std::lock_guard<std::mutex> lock(m);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(parts - 1);
  for (int64_t r0 = step; r0 < n; r0 += step) pool.emplace_back(run, r0, r0 + step < n ? r0 + step : n);
  run(0, step < n ? step : n);
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace i4p
