// Source bytes that vanish under a kernel: a SIGBUS turned into an error instead of the end of the
// process.
//
// convert and verify hand the kernels tensors that lie in mapped source shards. Python checks a
// shard's size before each mapped read, but a file cut (truncated by another process, or a read
// error of its storage) while a kernel is inside its bytes makes the next touch of a page past the
// new end a SIGBUS, which by default ends the process without a word. Every entry point of the
// library (api.cpp) and every thread for_rows starts runs inside a guard: a process-wide SIGBUS
// handler (fault_guard.cpp, installed when the library is loaded) finds the faulting thread's
// guard and siglongjmps back to it; the entry point then returns kVanished and the faulting
// address (i4p_last_fault), which Python maps to its shard and words as the truncated-shard error.
// A SIGBUS on a thread outside any guard, or one sent by kill() rather than raised by the access,
// goes to the handler installed before ours (Python's faulthandler under pytest) or, where there
// was none, to the default action: real crashes stay crashes.
//
// SIGSEGV is left alone: a mapped file that shrinks gives SIGBUS; a SIGSEGV inside a kernel is a
// bad address (a bug, or a mapping unmapped under it), which must crash loudly, not be reported as
// a damaged source.
//
// What a jump skips: the destructors of the frames between the guard and the faulting access (a
// kernel's std::vector buffers). They leak, once per vanished source (tens of MB at most, for a
// process that then stops with an error). for_rows guards each of its threads itself, so a jump
// never crosses a thread's join; the fault reaches the entry point as a SourceFault exception.
#pragma once

#include <setjmp.h>
#include <cstdint>
#include <stdexcept>

namespace i4p {

// thrown by for_rows when one of its threads took the fault; api.cpp turns it into kVanished
struct SourceFault : std::runtime_error {
  explicit SourceFault(uintptr_t at) : std::runtime_error("source bytes vanished"), address(at) {}
  uintptr_t address;
};

namespace fault {

struct Slot;

// This thread's guard for as long as it lives: installs `env` as where a SIGBUS on this thread
// jumps to (guards nest: the innermost one takes it), and puts the outer one back when it ends.
// Without a free slot (more guarded threads than kSlots at once) the region runs unguarded.
class Guard {
 public:
  explicit Guard(sigjmp_buf* env);
  ~Guard();
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;
  uintptr_t address() const;  // the faulting address, after the jump

 private:
  Slot* slot_;
  sigjmp_buf* outer_;
};

// after a jump: SIGBUS unblocked on this thread (it is not blocked inside the handler, SA_NODEFER;
// this makes sure, the jump does not restore the mask)
void unblock();

}  // namespace fault

// f() with a SIGBUS on this thread turned into a return: 0 when f returned, else the faulting
// address (1 when the kernel gave none). Exceptions from f pass through.
template <class F>
uintptr_t run_guarded(const F& f) {
  sigjmp_buf env;
  fault::Guard guard(&env);  // set before sigsetjmp: nothing in this frame changes after it
  if (sigsetjmp(env, 0) != 0) {
    fault::unblock();
    const uintptr_t at = guard.address();
    return at ? at : 1;
  }
  f();
  return 0;
}

}  // namespace i4p
