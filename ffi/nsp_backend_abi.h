/* The nsp storage backend ABI, version 1: what a shared object implements so that an nsp store can keep its
 * optimizer state on a device and run the update there.
 *
 * Plain C, usable from C and C++, with no nsp types: a vendor compiles against this header alone. A backend
 * library is named libnsp_backend_<name>.so and exports one symbol, nsp_backend_entry_v1, which returns a table
 * of functions (nsp_backend_v1). nsp opens one device per store shard with that table, and drives it from one
 * engine per shard:
 *
 *   - pages move between the device's storage and buffers the device allocated (read_page, write_page; two
 *     version slots per state, 0 and 1: an update reads one and writes the other, which sync makes durable);
 *   - the update kernel runs on one page of those buffers at a time (compute_launch, then compute_wait);
 *   - each page's checksum per slot is reported and set (so a store's manifests record, and its reads check, that
 *     every page holds what was written for its place);
 *   - the device reports its I/O counters and any number of named statistics.
 *
 * Conventions
 *   - Every call that can fail returns 0 on success and non-zero on failure, writing a NUL-terminated message
 *     of at most err_len bytes (truncated if longer) into the caller's err buffer. Messages should name the
 *     device, the page and the state concerned.
 *   - Every struct passed in either direction starts with struct_size, set by whoever fills it to
 *     sizeof(the struct it was compiled with). A later ABI version may only append fields; a reader must
 *     ignore fields beyond the struct_size it is given and treat missing trailing fields as zero.
 *   - The function table's first two fields, abi_version and struct_size, never move.
 *   - One device is called from several threads at once: page reads of different pages and states from several
 *     threads, writes from others, kernels from one. A device must be safe under that. Calls for one page and
 *     state never overlap.
 *   - Page buffers passed to read_page/write_page with scratch != 0 come from alloc_buffer; others are plain
 *     host memory of exactly n floats.
 *   - States: 0 = params (fp32 master), 1 = first moment, 2 = second moment. A kind uses a subset of them
 *     (nsp_backend_config.states_used).
 */
#ifndef NSP_BACKEND_ABI_H_
#define NSP_BACKEND_ABI_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define NSP_BACKEND_ABI_VERSION 1u
#define NSP_BACKEND_ENTRY_SYMBOL "nsp_backend_entry_v1"
#define NSP_BACKEND_NUM_STATES 3
#define NSP_BACKEND_STAT_NAME_BYTES 64

/* Put before the definition of nsp_backend_entry_v1, so that it is exported whatever the default visibility. */
#if defined(__GNUC__)
#define NSP_BACKEND_EXPORT __attribute__((visibility("default")))
#else
#define NSP_BACKEND_EXPORT
#endif

/* An open device: opaque to nsp. */
typedef struct nsp_backend_device nsp_backend_device;

/* What one device is opened for: one shard of a store. */
typedef struct nsp_backend_config {
  uint32_t struct_size;
  const char* shard_dir;   /* the shard's directory (the device may keep its pages there, or anywhere it likes) */
  int64_t shard_index;     /* this shard's index in the store, 0 .. num_devices - 1 */
  int64_t num_devices;     /* devices (shards) of the store, which share the host's link */
  int64_t size;            /* fp32 elements of each state of the shard */
  int64_t page_elems;      /* elements of one page; the last page of a shard may hold fewer */
  int32_t states_used[NSP_BACKEND_NUM_STATES]; /* non-zero for each state the optimizer keeps */
  int32_t checksum;        /* non-zero: each page carries a CRC-32C, checked on every read */
  int32_t pages_in_flight; /* page buffer sets the host streams an update through (pages between read and write) */
  const char* options;     /* "key=value;key=value" (may be empty): the device's own settings */
} nsp_backend_config;

/* Optimizer kinds and gradient element types. */
enum { NSP_KIND_ADAM = 0, NSP_KIND_ADAMW = 1, NSP_KIND_SGD = 2, NSP_KIND_ADAGRAD = 3 };
enum { NSP_GRAD_F32 = 0, NSP_GRAD_BF16 = 1 };

/* The hyperparameters of one update. step is 1-based (bias correction uses b^step). */
typedef struct nsp_hyper_params {
  uint32_t struct_size;
  int32_t kind;         /* NSP_KIND_* */
  float lr;
  int64_t step;
  double b1, b2, eps;   /* Adam/AdamW moments' decays; eps: Adam's denominator, AdaGrad's accumulator term */
  double weight_decay;  /* AdamW: decoupled; the others: L2 added to the gradient */
  double momentum;      /* SGD (0: plain SGD, no first moment) */
  int32_t nesterov;     /* SGD: Nesterov momentum */
  int32_t lazy;         /* an element whose gradient is exactly zero keeps its param and moments */
} nsp_hyper_params;

/* One page of optimizer state, in the device's buffers. The *_in and *_out pointers of a state may be equal (an
 * update in place). mu/nu are NULL for states the kind does not keep; the extra outputs may be NULL:
 * param_bf16_out, a bf16 copy of the new params (as uint16 bit patterns), and param_copy_out, a second fp32
 * copy (both in host memory, on their way to the caller). */
typedef struct nsp_state_span {
  uint32_t struct_size;
  const float* param_in;
  float* param_out;
  const float* mu_in;
  float* mu_out;
  const float* nu_in;
  float* nu_out;
  uint16_t* param_bf16_out;
  float* param_copy_out;
  int64_t size;         /* elements of the page */
} nsp_state_span;

/* The gradient of one page: dense (span.size elements of grad_type at `dense`), or compressed (when dense is
 * NULL): `count` sorted (index, value) pairs whose indices lie in [index_base, index_base + span.size) and add
 * up where they repeat. */
typedef struct nsp_page_grad {
  uint32_t struct_size;
  const void* dense;
  int32_t grad_type;        /* NSP_GRAD_*: the dense elements' or the values' type */
  const int32_t* indices;
  const void* values;
  int64_t count;
  int64_t index_base;
} nsp_page_grad;

/* Which page an update kernel runs on, and what that page's update moves over the host link as the host counted
 * it: the gradient coming in, and the new params going out (including params the host delivers somewhere the
 * span does not show). A device that models its links charges these. */
typedef struct nsp_page_info {
  uint32_t struct_size;
  int64_t page;             /* the page's index in the shard; -1 when the host cannot tell */
  int64_t host_in_bytes;
  int64_t host_out_bytes;
} nsp_page_info;

/* Bytes and pages the device's storage I/O moved since it was opened. */
typedef struct nsp_io_counts {
  uint32_t struct_size;
  int64_t read_bytes;
  int64_t write_bytes;
  int64_t pages_read;
  int64_t pages_written;
  int64_t pages_read_direct; /* of pages_read, those read bypassing any cache (0 if the notion does not apply) */
} nsp_io_counts;

/* One named statistic (NUL-terminated name of at most NSP_BACKEND_STAT_NAME_BYTES - 1 characters). */
typedef struct nsp_backend_stat {
  char name[NSP_BACKEND_STAT_NAME_BYTES];
  double value;
} nsp_backend_stat;

/* The function table. All functions are required unless marked optional (NULL allowed). */
typedef struct nsp_backend_v1 {
  uint32_t abi_version; /* NSP_BACKEND_ABI_VERSION the library was built with */
  uint32_t struct_size; /* sizeof(nsp_backend_v1) the library was built with */
  const char* name;     /* the backend's name, as in its file name */

  /* Opens the device for one shard; *out receives it. The shard's pages may already exist (a store reopened):
   * the device reads them as they are. */
  int (*open)(const nsp_backend_config* config, nsp_backend_device** out, char* err, size_t err_len);
  /* Closes it. Waits for any kernel still running. Buffers were freed before. */
  void (*close)(nsp_backend_device* device);

  /* Bytes a page buffer needs for a page of page_elems elements: room for the page plus whatever the device adds
   * on its way to storage (a checksum trailer, alignment). At least 4 * page_elems. */
  size_t (*page_buffer_bytes)(nsp_backend_device* device, int64_t page_elems);
  /* A buffer near the state, zero-filled, aligned to 4096 bytes and addressable by the host; NULL with a message
   * on failure. */
  void* (*alloc_buffer)(nsp_backend_device* device, size_t bytes, char* err, size_t err_len);
  void (*free_buffer)(nsp_backend_device* device, void* buffer, size_t bytes);

  /* Reads n elements of page `page` of `state` in version slot `slot` into dst (with scratch: a buffer from
   * alloc_buffer, which the device may fill beyond n). A page whose checksum does not match, or that is not
   * the page written for its place (page_checksums_set), is an error. */
  int (*read_page)(nsp_backend_device* device, int32_t slot, int32_t state, int64_t page, float* dst, int64_t n,
                   int32_t scratch, char* err, size_t err_len);
  /* Writes n elements of page `page` of `state` into slot `slot` (never the committed slot: the host only writes
   * the other one). With scratch the device may overwrite src's tail beyond n. */
  int (*write_page)(nsp_backend_device* device, int32_t slot, int32_t state, int64_t page, float* src, int64_t n,
                    int32_t scratch, char* err, size_t err_len);
  /* Makes everything written to `slot` durable. The host commits the slot's version only after this returns 0. */
  int (*sync)(nsp_backend_device* device, int32_t slot, char* err, size_t err_len);

  /* Starts the update kernel on one page and returns at once; *ticket names the launch. The memory of hp, span,
   * grad and info (and what they point to) stays valid and untouched until compute_wait of that ticket returns. */
  int (*compute_launch)(nsp_backend_device* device, const nsp_hyper_params* hp, const nsp_state_span* span,
                        const nsp_page_grad* grad, const nsp_page_info* info, uint64_t* ticket, char* err,
                        size_t err_len);
  /* Waits for the launch `ticket`; non-zero when that kernel failed (its outputs are then undefined). */
  int (*compute_wait)(nsp_backend_device* device, uint64_t ticket, char* err, size_t err_len);

  /* The checksum of every page of `state` in `slot`, as written there or set below, into out[0 .. pages - 1].
   * Returns 1 when every page's is known (out filled), 0 when not (or when the device keeps no checksums),
   * -1 on error. */
  int (*page_checksums_get)(nsp_backend_device* device, int32_t slot, int32_t state, uint32_t* out, int64_t pages,
                            char* err, size_t err_len);
  /* Sets them from a committed manifest: from then on a read checks each page against its entry. */
  int (*page_checksums_set)(nsp_backend_device* device, int32_t slot, int32_t state, const uint32_t* crcs,
                            int64_t pages, char* err, size_t err_len);

  /* The storage I/O counters; the device sets out->struct_size. */
  void (*io_counts)(nsp_backend_device* device, nsp_io_counts* out);
  /* Named statistics: writes up to `capacity` of them into out and returns how many there are (which may
   * exceed capacity: call again with more room), or -1 with a message. */
  int64_t (*stats)(nsp_backend_device* device, nsp_backend_stat* out, int64_t capacity, char* err,
                   size_t err_len);

  /* Optional: called before and after each update that streams pages through the buffers (ok = 0: the update
   * failed). All of that update's reads, kernels and writes happen in between. */
  void (*update_begin)(nsp_backend_device* device);
  void (*update_end)(nsp_backend_device* device, int32_t ok);
} nsp_backend_v1;

/* The one exported symbol. host_abi_version is NSP_BACKEND_ABI_VERSION of the nsp loading the library; return
 * the table (static storage), or NULL when the library cannot serve that version. */
typedef const nsp_backend_v1* (*nsp_backend_entry_v1_fn)(uint32_t host_abi_version);
const nsp_backend_v1* nsp_backend_entry_v1(uint32_t host_abi_version);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* NSP_BACKEND_ABI_H_ */
