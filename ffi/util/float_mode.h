// The caller's floating-point mode, carried onto the kernels' pool threads.
//
// XLA:CPU runs its computations with float32 denormals flushed to zero (FTZ/DAZ in MXCSR on x86). An FFI handler
// that computes floats XLA also computes (a hash of `p + u`, `residual + gradient`) must round as XLA does on
// every thread that runs part of it, not only on the calling one: capture the mode on the caller, enter it in
// each task.
#pragma once

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define NSP_HAVE_MXCSR 1
#endif

namespace nsp {

class CallerFloatMode {
 public:
#ifdef NSP_HAVE_MXCSR
  CallerFloatMode() : csr_(_mm_getcsr()) {}
  class Scope {
   public:
    explicit Scope(unsigned int csr) : saved_(_mm_getcsr()) { _mm_setcsr(csr); }
    ~Scope() { _mm_setcsr(saved_); }

   private:
    unsigned int saved_;
  };
  Scope Enter() const { return Scope(csr_); }

 private:
  unsigned int csr_;
#else
  struct Scope {};
  Scope Enter() const { return {}; }
#endif
};

}  // namespace nsp
