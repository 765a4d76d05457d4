"""The C++ engine's Python names: the one module of nsp that imports the compiled extension ``nsp._nsp_ffi``.

Every other part of nsp reaches the C++ side through the names below (``tests/test_package_structure.py`` checks
it): ``nsp.storage`` its shard engines, ``nsp.primitives`` the XLA FFI targets it registers with JAX, the
kernels' settings and the spill areas of activation offload, ``nsp.distributed`` the abort guard. The module sits
below every other one: it imports nothing of nsp but the extension, so any layer may use it. Importing it
registers nothing with JAX (``nsp.primitives`` does that).
"""

from __future__ import annotations

from nsp import _nsp_ffi

# ---- shard engines (nsp.storage) -----------------------------------------------------------------------------

#: One store shard's engine: its pages, version slots and manifest, its update, reads and writes.
ShardEngine = _nsp_ffi.ShardEngine
#: Lets go of the handle a jitted step names an engine by (``ShardEngine.register``).
unregister_engine = _nsp_ffi.unregister_engine
#: Loads a backend library by name (no device is opened); raises ``RuntimeError`` saying why it cannot.
find_backend = _nsp_ffi.find_backend
#: The folder the backend libraries shipped with nsp live in.
backend_dir = _nsp_ffi.backend_dir
#: Whether a float32 array (or a bfloat16 one, as its uint16 bit patterns) holds no NaN or Inf: one
#: multithreaded pass.
all_finite = _nsp_ffi.all_finite
#: The CRC-32C of a byte array (what each page's trailer and manifest record), optionally continuing ``crc``.
crc32c = _nsp_ffi.crc32c

# ---- the XLA FFI targets and the kernels' settings (nsp.primitives) ------------------------------------------

#: The CPU handlers of the FFI targets: name -> capsule.
registrations = _nsp_ffi.registrations
#: The CUDA handlers: ``{"device": name -> capsule, "host": name -> capsule}`` (host: the software model's).
cuda_registrations = _nsp_ffi.cuda_registrations
cuda_use_library = _nsp_ffi.cuda_use_library
cuda_search_dirs = _nsp_ffi.cuda_search_dirs
cuda_stats = _nsp_ffi.cuda_stats
kernel_isa = _nsp_ffi.kernel_isa
get_num_threads = _nsp_ffi.get_num_threads
set_num_threads = _nsp_ffi.set_num_threads
engine_cpus = _nsp_ffi.engine_cpus
stream_roofline = _nsp_ffi.stream_roofline
kernel_time = _nsp_ffi.kernel_time

# ---- the distributed runtime's abort guard (nsp.distributed) -------------------------------------------------

install_abort_guard = _nsp_ffi.install_abort_guard
remove_abort_guard = _nsp_ffi.remove_abort_guard

# ---- activation offload's spill areas (nsp.primitives.spill) --------------------------------------------------

spill_open = _nsp_ffi.spill_open
spill_close = _nsp_ffi.spill_close
spill_reset = _nsp_ffi.spill_reset
spill_stats = _nsp_ffi.spill_stats
