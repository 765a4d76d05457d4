// The AXDIMM runtime API as nsp reads it from the paper that describes the platform (its Table 2 and Sections 3-4):
// a DDR4 DIMM with an FPGA and two independent DRAM channels, each with its own arbiter and Adam kernel.
//
// The paper's runtime library (libaxdimm.so) is not public. This header is the interface as the paper describes it,
// written down in C by nsp, with every name prefixed nspAxdimm so that nobody takes it for the vendor's: an axdimm
// backend dlopens a library exporting these symbols -- on the platform, a thin shim over the vendor runtime; in the
// tests, the software model libaxdimm_model.so (ffi/backends/axdimm/axdimm_model.cc).
//
// The paper's calls and their counterparts here:
//   Axdimm(device)                                   nspAxdimmOpen / nspAxdimmClose
//   MallocX(nbytes, channel) / FreeX(ptr)            nspAxdimmMallocX / nspAxdimmFreeX
//   MemcpyX2Y(dst, src, nbytes)                      nspAxdimmMemcpyH2X / nspAxdimmMemcpyX2H (host <-> module; the
//                                                    paper's GPU and NVMe endpoints go through host memory here)
//   SetArbiterAcc(channel)                           nspAxdimmSetArbiterAcc, and its inverse nspAxdimmSetArbiterNormal
//   RunAdamOnAxdimmAsync(p, m, v, g, n, t, channel)  nspAxdimmRunAdamAsync (arguments in a struct), completion by
//                                                    nspAxdimmWait / nspAxdimmPoll (the paper polls a status CSR)
// Where nsp goes beyond the paper's kernel (dense fp32 Adam) it says so on the field: AdamW, bf16 and Top-K gradients,
// lazy updates and the bf16 params copy, which the updater kernel of ffi/backends/hls computes.
//
// Rules the hardware imposes, which the model enforces:
//   - arbiter modes are exclusive per channel: in acceleration mode the kernel owns the channel's DRAM and host
//     accesses are blocked (copies fail with NSP_AXDIMM_EACCES); in normal mode the kernel cannot start
//     (NSP_AXDIMM_EMODE). The other channel is unaffected, so one channel transfers while the other computes.
//   - a channel's kernel sees only that channel's DRAM: every address of a launch must lie on its channel.
//   - module memory is finite; an allocation that does not fit fails with NSP_AXDIMM_ENOMEM (the caller then
//     evicts -- the paper evicts tensors already updated this iteration first -- and retries).
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef void* nspAxdimmHandle;
// A module address: which channel, and where in it. Interior addresses (base + byte offset) are valid wherever an
// allocation's base is, so a page of a tensor is addressed without a separate allocation. 0 means "none".
typedef uint64_t nspAxdimmAddr;

#define NSP_AXDIMM_NUM_CHANNELS 2

// Status codes: every call returns one; nspAxdimmLastError gives the message of this thread's last failure.
enum {
  NSP_AXDIMM_OK = 0,
  NSP_AXDIMM_EINVAL = 1,   // a bad argument (unknown address, size past an allocation, wrong channel, bad indices)
  NSP_AXDIMM_ENOMEM = 2,   // the channel's free memory is smaller than the allocation
  NSP_AXDIMM_EACCES = 3,   // host access to a channel in acceleration mode: the arbiter blocks it
  NSP_AXDIMM_EMODE = 4,    // a kernel launch on a channel in normal mode
  NSP_AXDIMM_EBUSY = 5,    // the channel's kernel is running (launch, mode switch or free must wait for it)
  NSP_AXDIMM_EIO = 6,      // a copy between host and module failed
  NSP_AXDIMM_EKERNEL = 7   // the kernel ended in an error (nspAxdimmWait reports it)
};

enum { NSP_AXDIMM_MODE_NORMAL = 0, NSP_AXDIMM_MODE_ACCELERATION = 1 };

// One launch of the update kernel (the paper's RunAdamOnAxdimmAsync arguments, plus nsp's extensions).
typedef struct {
  uint32_t struct_size;  // sizeof(nspAxdimmAdamArgs): lets the runtime accept older, shorter versions
  int32_t kind;          // NSP_HLS_ADAM (the paper's kernel) or NSP_HLS_ADAMW (nsp)
  int32_t grad_format;   // NSP_HLS_GRAD_F32 (the paper's) or NSP_HLS_GRAD_BF16 / NSP_HLS_TOPK_F32 / _BF16 (nsp)
  int32_t lazy;          // nsp: elements with a zero gradient keep p, m, v
  nspAxdimmAddr p, m, v;  // fp32 state, updated in place
  nspAxdimmAddr grad;     // dense gradient (nparams elements) or Top-K values (topk_count elements)
  nspAxdimmAddr indices;  // nsp: sorted int32 Top-K indices in [index_base, index_base + nparams); 0 when dense
  nspAxdimmAddr p_bf16;   // nsp: bf16 copy of the new params; 0 for none
  int64_t nparams;
  int64_t topk_count;
  int64_t index_base;
  int64_t step;  // t, 1-based
  float lr;
  int32_t reserved;  // 0
  double b1, b2, eps, weight_decay;  // weight_decay: L2 for Adam, decoupled for AdamW
} nspAxdimmAdamArgs;

typedef int (*nsp_nspAxdimmOpen_fn)(const char* device, nspAxdimmHandle* out);
typedef int (*nsp_nspAxdimmClose_fn)(nspAxdimmHandle h);  // waits for running kernels, frees everything
typedef int (*nsp_nspAxdimmMallocX_fn)(nspAxdimmHandle h, size_t nbytes, int channel, nspAxdimmAddr* out);
typedef int (*nsp_nspAxdimmFreeX_fn)(nspAxdimmHandle h, nspAxdimmAddr addr);
typedef int (*nsp_nspAxdimmMemInfo_fn)(nspAxdimmHandle h, int channel, size_t* capacity, size_t* free_bytes);
typedef int (*nsp_nspAxdimmMemcpyH2X_fn)(nspAxdimmHandle h, nspAxdimmAddr dst, const void* src, size_t nbytes);
typedef int (*nsp_nspAxdimmMemcpyX2H_fn)(nspAxdimmHandle h, void* dst, nspAxdimmAddr src, size_t nbytes);
typedef int (*nsp_nspAxdimmSetArbiterAcc_fn)(nspAxdimmHandle h, int channel);
typedef int (*nsp_nspAxdimmSetArbiterNormal_fn)(nspAxdimmHandle h, int channel);
typedef int (*nsp_nspAxdimmGetArbiterMode_fn)(nspAxdimmHandle h, int channel, int* mode);
typedef int (*nsp_nspAxdimmRunAdamAsync_fn)(nspAxdimmHandle h, const nspAxdimmAdamArgs* args, int channel);
typedef int (*nsp_nspAxdimmWait_fn)(nspAxdimmHandle h, int channel);  // the finished kernel's status
typedef int (*nsp_nspAxdimmPoll_fn)(nspAxdimmHandle h, int channel, int* done);
typedef const char* (*nsp_nspAxdimmLastError_fn)(void);  // this thread's last failure, "" if none

// The symbols to dlsym; each name's pointer type is nsp_##name##_fn.
#define NSP_AXDIMM_SYMBOLS(X)                                                                                      \
  X(nspAxdimmOpen) X(nspAxdimmClose) X(nspAxdimmMallocX) X(nspAxdimmFreeX) X(nspAxdimmMemInfo) X(nspAxdimmMemcpyH2X) \
  X(nspAxdimmMemcpyX2H) X(nspAxdimmSetArbiterAcc) X(nspAxdimmSetArbiterNormal) X(nspAxdimmGetArbiterMode)           \
  X(nspAxdimmRunAdamAsync) X(nspAxdimmWait) X(nspAxdimmPoll) X(nspAxdimmLastError)

#ifdef __cplusplus
}
#endif
