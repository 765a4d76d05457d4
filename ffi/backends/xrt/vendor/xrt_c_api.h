// The part of the Xilinx Runtime (XRT) C API that nsp's xrt backend uses, as function-pointer types for dlopen/dlsym.
//
// The backend never links XRT: it dlopens the vendor library (libxrt_coreutil.so on a SmartSSD host, or the software
// model libxrt_model.so that the tests build from ffi/backends/xrt/xrt_model.cc) and looks each symbol up by its XRT
// name (NSP_XRT_SYMBOLS below). The signatures are those of XRT's public C API (experimental/xrt_device.h, xrt_bo.h,
// xrt_kernel.h, xrt_error.h, 2020.2 and later); enums appear as int, their values under NSP_ names, so this header
// compiles next to XRT's own or without it.
//
// Which calls, and why:
//   xrtDeviceOpen / xrtDeviceClose          one handle per SmartSSD's FPGA (index: the card's place in xbutil's list)
//   xrtDeviceLoadXclbinFile                 program the updater bitstream (the xclbin built from ffi/backends/hls)
//   xrtDeviceGetXclbinUUID                  the uuid xrtPLKernelOpen needs
//   xrtPLKernelOpen / xrtKernelClose        the kernel "nsp_update_page"
//   xrtKernelArgGroupId                     the DDR bank an argument's buffer must live in (BO allocation)
//   xrtBOAlloc (+ P2P flag) / xrtBOFree     page buffers in the FPGA's DDR; P2P ones are what the SSD DMAs into
//   xrtBOSubAlloc                           a page's slice of one large preallocated buffer (fixed memory use)
//   xrtBOMap                                host view of a BO; for a P2P BO, the PCIe window P2P transfers go through
//   xrtBOSync                               host buffer <-> device DDR (normal BOs: gradients in, params out)
//   xrtBOWrite / xrtBORead                  copy into / out of a BO's host buffer
//   xrtRunOpen / xrtRunSetArg / xrtRunStart one asynchronous kernel run per page; a run handle is reused
//   xrtRunWait / xrtRunState / xrtRunClose  completion; ERT_CMD_STATE_COMPLETED or an error state
//   xrtErrorGetString                       text for an error code
//
// P2P between the SmartSSD's NVMe and its FPGA is not an XRT call: the host maps a P2P BO (xrtBOMap) and calls
// pread/pwrite on the NVMe file (O_DIRECT) with the mapped address, and the SSD's DMA lands in the FPGA's DDR without
// crossing the host link. nspXrtP2PRead/nspXrtP2PWrite name that transfer: the software model exports them (so tests
// can inject DMA faults into the P2P path); against real XRT, which lacks them, the backend does the same
// pread/pwrite into xrtBOMap's address itself.
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

// XRT's handle and scalar types (identical typedefs are allowed next to XRT's own headers).
typedef void* xrtDeviceHandle;
typedef void* xrtBufferHandle;
typedef void* xrtKernelHandle;
typedef void* xrtRunHandle;
typedef uint64_t xrtBufferFlags;
typedef uint32_t xrtMemoryGroup;
typedef uint64_t xrtErrorCode;
typedef unsigned char nsp_xrt_uuid[16];  // XRT's xuid_t

// Buffer flags (XRT_BO_FLAGS_* in xrt_mem.h). The low 24 bits may carry a memory bank index.
#define NSP_XRT_BO_FLAGS_NONE 0u
#define NSP_XRT_BO_FLAGS_DEV_ONLY (1u << 28)
#define NSP_XRT_BO_FLAGS_HOST_ONLY (1u << 29)
#define NSP_XRT_BO_FLAGS_P2P (1u << 30)

// enum xclBOSyncDirection.
#define NSP_XRT_BO_SYNC_TO_DEVICE 0
#define NSP_XRT_BO_SYNC_FROM_DEVICE 1

// enum ert_cmd_state (ert.h): what xrtRunWait and xrtRunState return.
#define NSP_ERT_CMD_STATE_NEW 1
#define NSP_ERT_CMD_STATE_QUEUED 2
#define NSP_ERT_CMD_STATE_RUNNING 3
#define NSP_ERT_CMD_STATE_COMPLETED 4
#define NSP_ERT_CMD_STATE_ERROR 5
#define NSP_ERT_CMD_STATE_ABORT 6

// The kernel's argument positions (xrtRunSetArg's index): nsp_update_page's parameters in order (ffi/backends/hls).
// Buffers are passed as xrtBufferHandle, the scalars as int32/uint32.
enum {
  NSP_XRT_ARG_P_IN = 0, NSP_XRT_ARG_M_IN, NSP_XRT_ARG_V_IN, NSP_XRT_ARG_P_OUT, NSP_XRT_ARG_M_OUT, NSP_XRT_ARG_V_OUT,
  NSP_XRT_ARG_P_BF16_OUT, NSP_XRT_ARG_GRAD_F32, NSP_XRT_ARG_GRAD_BF16, NSP_XRT_ARG_TOPK_IDX, NSP_XRT_ARG_COEFFS,
  NSP_XRT_ARG_N, NSP_XRT_ARG_TOPK_COUNT, NSP_XRT_ARG_INDEX_BASE, NSP_XRT_ARG_FLAGS, NSP_XRT_NUM_ARGS
};
#define NSP_XRT_KERNEL_NAME "nsp_update_page"

// Device. Return 0 on success or an errno value unless noted; handles are NULL on error with errno set.
typedef xrtDeviceHandle (*nsp_xrtDeviceOpen_fn)(unsigned int index);
typedef int (*nsp_xrtDeviceClose_fn)(xrtDeviceHandle dhdl);
typedef int (*nsp_xrtDeviceLoadXclbinFile_fn)(xrtDeviceHandle dhdl, const char* xclbin_path);
typedef int (*nsp_xrtDeviceGetXclbinUUID_fn)(xrtDeviceHandle dhdl, nsp_xrt_uuid out);

// Kernel.
typedef xrtKernelHandle (*nsp_xrtPLKernelOpen_fn)(xrtDeviceHandle dhdl, const nsp_xrt_uuid xclbin_id, const char* name);
typedef int (*nsp_xrtKernelClose_fn)(xrtKernelHandle khdl);
typedef int (*nsp_xrtKernelArgGroupId_fn)(xrtKernelHandle khdl, int argno);  // >= 0, or negative on error

// Buffer objects.
typedef xrtBufferHandle (*nsp_xrtBOAlloc_fn)(xrtDeviceHandle dhdl, size_t size, xrtBufferFlags flags,
                                             xrtMemoryGroup grp);
typedef xrtBufferHandle (*nsp_xrtBOSubAlloc_fn)(xrtBufferHandle parent, size_t size, size_t offset);
typedef int (*nsp_xrtBOFree_fn)(xrtBufferHandle bhdl);
typedef size_t (*nsp_xrtBOSize_fn)(xrtBufferHandle bhdl);
typedef void* (*nsp_xrtBOMap_fn)(xrtBufferHandle bhdl);
typedef int (*nsp_xrtBOSync_fn)(xrtBufferHandle bhdl, int dir, size_t size, size_t offset);
typedef int (*nsp_xrtBOWrite_fn)(xrtBufferHandle bhdl, const void* src, size_t size, size_t seek);
typedef int (*nsp_xrtBORead_fn)(xrtBufferHandle bhdl, void* dst, size_t size, size_t skip);

// Runs. xrtRunSetArg is variadic: one xrtBufferHandle or one scalar after the index.
typedef xrtRunHandle (*nsp_xrtRunOpen_fn)(xrtKernelHandle khdl);
typedef int (*nsp_xrtRunSetArg_fn)(xrtRunHandle rhdl, int index, ...);
typedef int (*nsp_xrtRunStart_fn)(xrtRunHandle rhdl);
typedef int (*nsp_xrtRunWait_fn)(xrtRunHandle rhdl);   // an NSP_ERT_CMD_STATE_* value
typedef int (*nsp_xrtRunState_fn)(xrtRunHandle rhdl);  // an NSP_ERT_CMD_STATE_* value
typedef int (*nsp_xrtRunClose_fn)(xrtRunHandle rhdl);

// Errors: writes the text for `error` into out[len] (NUL-terminated); *out_len gets the length needed, with the NUL.
typedef int (*nsp_xrtErrorGetString_fn)(xrtDeviceHandle dhdl, xrtErrorCode error, char* out, size_t len,
                                        size_t* out_len);

// Not XRT (see above): P2P transfer of `size` bytes between an open file and a P2P BO. 0 or an errno value.
typedef int (*nsp_nspXrtP2PRead_fn)(xrtBufferHandle bhdl, int fd, size_t size, size_t bo_offset, off_t file_offset);
typedef int (*nsp_nspXrtP2PWrite_fn)(xrtBufferHandle bhdl, int fd, size_t size, size_t bo_offset, off_t file_offset);

// The symbol names to dlsym, in one list: X(name) for each required XRT call, OPT(name) for the optional nsp ones;
// each name's pointer type is nsp_##name##_fn.
#define NSP_XRT_SYMBOLS(X, OPT)                                                                                     \
  X(xrtDeviceOpen) X(xrtDeviceClose) X(xrtDeviceLoadXclbinFile) X(xrtDeviceGetXclbinUUID) X(xrtPLKernelOpen)       \
  X(xrtKernelClose) X(xrtKernelArgGroupId) X(xrtBOAlloc) X(xrtBOSubAlloc) X(xrtBOFree) X(xrtBOSize) X(xrtBOMap)   \
  X(xrtBOSync) X(xrtBOWrite) X(xrtBORead) X(xrtRunOpen) X(xrtRunSetArg) X(xrtRunStart) X(xrtRunWait)             \
  X(xrtRunState) X(xrtRunClose) X(xrtErrorGetString) OPT(nspXrtP2PRead) OPT(nspXrtP2PWrite)

#ifdef __cplusplus
}
#endif
