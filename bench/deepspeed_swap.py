"""DeepSpeed's NVMe optimizer swap, driven through DeepSpeed's own ops: the baseline the file tier is measured
against.

ZeRO-Infinity with ``offload_optimizer: {device: nvme}`` keeps each sub-group's fp32 params and Adam moments in
swap files and, per optimizer step, for every sub-group in turn: swaps p, m, v in (its aio handle's
``async_pread`` into page-locked buffers, then ``wait``), runs ``DeepSpeedCPUAdam`` on them, and swaps them out
(``async_pwrite``, ``wait``). Two arrangements, chosen by ``pipeline_read`` / ``pipeline_write``:

  serial     (PartitionedOptimizerSwapper) one aio handle; swap in, update, swap out, one sub-group after another
  pipelined  (PipelinedOptimizerSwapper) a read handle and a write handle: while a sub-group is updated, the next
             one's swap-in and the previous one's swap-out run; the last swap-out is waited for

``DeepSpeedOptimizerSwap`` does the same with the same ops, configured with DeepSpeed's documented defaults
(``aio`` block_size 1 MiB, queue_depth 8, intra_op_parallelism 1, single_submit false, overlap_events true, read
from the installed DeepSpeed), buffers from the handle's ``new_cpu_locked_tensor`` (page-aligned, mlocked: the
aio op reads and writes them O_DIRECT without a bounce copy), one swap file per tensor and sub-group, and the
gradient handed over as ZeRO hands over an unswapped gradient partition (copied into the sub-group's pinned
gradient buffer at swap-in). The files are not fsynced: DeepSpeed's swapper does not sync either.

Installing it: ``apt-get install -y libaio-dev && pip install -e ".[bench]"``. Its C++ ops (async_io, cpu_adam)
are compiled with ninja on first use (minutes, once; cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

INSTALL_HINT = 'apt-get install -y libaio-dev && pip install -e ".[bench]"'
ADAM_STATES = ("fp32_param", "exp_avg", "exp_avg_sq")  # the swap files of a sub-group, as ZeRO's swapper names them


def _can_lock(nbytes: int) -> tuple[bool, str]:
    """Whether mlock of ``nbytes`` more can succeed (CAP_IPC_LOCK, or a large enough RLIMIT_MEMLOCK, raised if the
    hard limit allows). DeepSpeed's allocator returns no buffer when mlock fails, so this is checked first."""
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:") and int(line.split()[1], 16) & (1 << 14):
                    return True, "CAP_IPC_LOCK"
    except (OSError, ValueError):
        pass
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= nbytes:
        return True, f"RLIMIT_MEMLOCK {soft}"
    want = nbytes + soft
    if hard == resource.RLIM_INFINITY or hard >= want:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (want, hard))
        return True, f"RLIMIT_MEMLOCK raised to {want}"
    return False, f"mlock of {nbytes} bytes exceeds RLIMIT_MEMLOCK ({soft}/{hard}); raise it with ulimit -l"


def status() -> dict[str, Any]:
    """Whether DeepSpeed's aio op and DeepSpeedCPUAdam load here; its version and documented swap defaults.

    ``available`` False comes with ``reason``: what is missing and how to install it. Loading builds the ops on
    first use (minutes).
    """
    out: dict[str, Any] = {"available": False, "install": INSTALL_HINT}
    try:
        import torch
    except ImportError:
        out["reason"] = f"torch is not installed ({INSTALL_HINT})"
        return out
    try:
        import deepspeed
    except Exception as e:  # noqa: BLE001  (deepspeed raises many kinds of errors at import)
        out["reason"] = f"deepspeed is not importable: {type(e).__name__}: {e} ({INSTALL_HINT})"
        return out
    out["version"] = deepspeed.__version__
    out["torch"] = torch.__version__
    try:
        from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

        out["aio_defaults"] = dict(AIO_DEFAULT_DICT)
        out["sub_group_size_default"] = int(DeepSpeedZeroConfig.model_fields["sub_group_size"].default)
        out["buffer_count_default"] = int(DeepSpeedZeroOffloadOptimizerConfig.model_fields["buffer_count"].default)
    except Exception as e:  # noqa: BLE001
        out["reason"] = f"deepspeed {deepspeed.__version__}: its swap configuration could not be read ({e})"
        return out
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            out["reason"] = (f"deepspeed {deepspeed.__version__}: its async_io op cannot be built here (libaio "
                             f"headers missing? {INSTALL_HINT})")
            return out
        builder.load(verbose=False)
    except Exception as e:  # noqa: BLE001
        out["reason"] = f"deepspeed {deepspeed.__version__}: async_io op failed to build/load: {type(e).__name__}: {e}"
        return out
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load(verbose=False)
    except Exception as e:  # noqa: BLE001
        out["reason"] = f"deepspeed {deepspeed.__version__}: cpu_adam op failed to build/load: {type(e).__name__}: {e}"
        return out
    out["available"] = True
    return out


class DeepSpeedOptimizerSwap:
    """fp32 Adam state of ``params.size`` parameters in DeepSpeed swap files under ``directory``, stepped the way
    ZeRO-Infinity's optimizer swapper steps it.

    ``sub_group_numel``: parameters per sub-group (ZeRO's ``sub_group_size``; the last one takes the rest).
    ``pipelined``: PipelinedOptimizerSwapper's arrangement (pipeline_read and pipeline_write) instead of
    PartitionedOptimizerSwapper's. ``swap_gradient``: the gradient is swapped out to files first (as ZeRO-Infinity's
    backward does with gradients it cannot keep) and read back with each sub-group's state; otherwise it comes from
    host memory. ``aio``: overrides of DeepSpeed's ``aio`` defaults.
    """

    def __init__(self, directory: str, params: np.ndarray, *, sub_group_numel: int, pipelined: bool, lr: float,
                 betas: tuple[float, float], eps: float, threads: int | None = None, aio: dict | None = None,
                 swap_gradient: bool = False):
        import torch
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import AsyncIOBuilder
        from deepspeed.runtime.swap_tensor import constants as C
        from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT
        from deepspeed.runtime.swap_tensor.utils import AIO_ALIGNED_BYTES

        self._torch = torch
        if threads is not None:
            torch.set_num_threads(threads)  # DeepSpeedCPUAdam's OpenMP loop runs in torch's OpenMP runtime
        self.aio = {**AIO_DEFAULT_DICT, **(aio or {})}
        op = AsyncIOBuilder().load(verbose=False)

        def new_handle():
            return op.aio_handle(block_size=self.aio[C.AIO_BLOCK_SIZE], queue_depth=self.aio[C.AIO_QUEUE_DEPTH],
                                 single_submit=self.aio[C.AIO_SINGLE_SUBMIT],
                                 overlap_events=self.aio[C.AIO_OVERLAP_EVENTS],
                                 intra_op_parallelism=self.aio[C.AIO_INTRA_OP_PARALLELISM])

        self.pipelined = pipelined
        self.swap_gradient = swap_gradient
        self.read_handle = new_handle()
        self.write_handle = new_handle() if pipelined else self.read_handle
        # ZeRO pads every swapped tensor to AIO_ALIGNED_BYTES x intra_op_parallelism (OptimizerSwapper).
        align = AIO_ALIGNED_BYTES * self.aio[C.AIO_INTRA_OP_PARALLELISM] // 4
        n = int(params.size)
        self.numel = n
        self.groups: list[tuple[int, int, int]] = []  # (start, numel, aligned numel)
        for start in range(0, n, sub_group_numel):
            numel = min(sub_group_numel, n - start)
            self.groups.append((start, numel, -(-numel // align) * align))
        largest = max(g[2] for g in self.groups)
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.paths = [[os.path.join(directory, f"{i}.{name}.tensor.swp") for name in ADAM_STATES]
                      for i in range(len(self.groups))]
        self.grad_paths = [os.path.join(directory, f"{i}.gradient.tensor.swp") for i in range(len(self.groups))]

        # Page-locked buffers, as SwapBufferManager allocates them: p, m, v and the gradient per sub-group in
        # flight (one sub-group serial; three pipelined: the one updated, the next read, the previous written).
        sets = 3 if pipelined else 1
        per_set = len(ADAM_STATES) + 1
        nbytes = sets * per_set * largest * 4
        ok, why = _can_lock(nbytes)
        if not ok:
            raise RuntimeError(why)
        self.lock_note = why
        example = torch.zeros(1, dtype=torch.float32)
        self._locked = []
        self.sets = []
        for _ in range(sets):
            bufs = [self.read_handle.new_cpu_locked_tensor(largest, example).zero_() for _ in range(per_set)]
            self._locked += bufs
            self.sets.append(bufs)
        assert all(self.read_handle.is_pinned(b) for b in self._locked), "DeepSpeed did not lock its swap buffers"

        self.params = [torch.nn.Parameter(torch.empty(0)) for _ in self.groups]
        self.opt = DeepSpeedCPUAdam(self.params, lr=lr, betas=betas, eps=eps, weight_decay=0.0,
                                    bias_correction=True, adamw_mode=False)
        self.t = 0
        self.grad: np.ndarray | None = None
        self.bytes_read = 0
        self.bytes_written = 0
        self.phases: dict[str, list[float]] = {"read_wait": [], "compute": [], "write_wait": []}

        # The initial state, written through the swapper's own write path: p, and zero moments.
        bufs = self.sets[0]
        for i, (start, numel, aligned) in enumerate(self.groups):
            bufs[0][:numel].copy_(torch.from_numpy(params[start:start + numel]))
            bufs[0][numel:aligned].zero_()
            bufs[1][:aligned].zero_()
            bufs[2][:aligned].zero_()
            for b, path in zip(bufs, self.paths[i]):
                assert self.write_handle.async_pwrite(b.narrow(0, 0, aligned), path, 0) == 0
            assert self.write_handle.wait() == len(ADAM_STATES)
        self.bytes_read = self.bytes_written = 0

    # -- the pieces of OptimizerSwapper, on sub-group i ---------------------------------------------------------

    def _swap_in(self, i: int, bufs) -> int:
        """Starts the reads of sub-group i's state (and gradient) into ``bufs``; returns how many were started."""
        start, numel, aligned = self.groups[i]
        ops = 0
        for b, path in zip(bufs, self.paths[i]):
            assert self.read_handle.async_pread(b.narrow(0, 0, aligned), path, 0) == 0
            ops += 1
        self.bytes_read += len(ADAM_STATES) * aligned * 4
        if self.swap_gradient:
            assert self.read_handle.async_pread(bufs[3].narrow(0, 0, aligned), self.grad_paths[i], 0) == 0
            self.bytes_read += aligned * 4
            ops += 1
        else:  # an unswapped gradient partition is copied into the pinned gradient buffer (optimizer_utils.py)
            bufs[3][:numel].copy_(self._torch.from_numpy(self.grad[start:start + numel]))
        return ops

    def _swap_out(self, i: int, bufs) -> int:
        aligned = self.groups[i][2]
        for b, path in zip(bufs, self.paths[i]):
            assert self.write_handle.async_pwrite(b.narrow(0, 0, aligned), path, 0) == 0
        self.bytes_written += len(ADAM_STATES) * aligned * 4
        return len(ADAM_STATES)

    def _adam(self, i: int, bufs) -> None:
        """DeepSpeedCPUAdam on sub-group i, as ZeRO's _optimizer_step runs it: the sub-group's flat fp32 param is
        the only param of the group, its state tensors are the swap buffers."""
        numel = self.groups[i][1]
        p = self.params[i]
        p.data = bufs[0].narrow(0, 0, numel)
        p.grad = bufs[3].narrow(0, 0, numel)
        state = self.opt.state[p]
        state["step"] = self.t - 1  # DeepSpeedCPUAdam counts it up
        state["exp_avg"] = bufs[1].narrow(0, 0, numel)
        state["exp_avg_sq"] = bufs[2].narrow(0, 0, numel)
        self.opt.param_groups[0]["params"] = [p]
        self.opt.step()
        self.opt.param_groups[0]["params"] = []
        p.grad = None

    def _swap_out_gradients(self) -> None:
        """The backward's gradient swap-out (AsyncTensorSwapper): each sub-group's gradient copied into a pinned
        buffer and written to its file."""
        staging = self.sets[0][3]
        for i, (start, numel, aligned) in enumerate(self.groups):
            staging[:numel].copy_(self._torch.from_numpy(self.grad[start:start + numel]))
            assert self.write_handle.async_pwrite(staging.narrow(0, 0, aligned), self.grad_paths[i], 0) == 0
            assert self.write_handle.wait() == 1
            self.bytes_written += aligned * 4

    # -- a step -----------------------------------------------------------------------------------------------------

    def step(self, grad: np.ndarray) -> None:
        """One optimizer step over every sub-group with gradient ``grad`` (float32, params.size)."""
        self.grad = grad
        self.t += 1
        if self.swap_gradient:
            self._swap_out_gradients()
        read_wait = compute = write_wait = 0.0
        if not self.pipelined:
            bufs = self.sets[0]
            for i in range(len(self.groups)):
                t0 = time.perf_counter()
                ops = self._swap_in(i, bufs)
                assert self.read_handle.wait() == ops
                t1 = time.perf_counter()
                self._adam(i, bufs)
                t2 = time.perf_counter()
                ops = self._swap_out(i, bufs)
                assert self.write_handle.wait() == ops
                t3 = time.perf_counter()
                read_wait, compute, write_wait = read_wait + t1 - t0, compute + t2 - t1, write_wait + t3 - t2
        else:
            groups = len(self.groups)
            reading = self._swap_in(0, self.sets[0])  # ops in flight on the read handle (sub-group 0)
            writing = 0  # ops in flight on the write handle (the previous sub-group's swap-out)
            for i in range(groups):
                bufs = self.sets[i % 3]
                t0 = time.perf_counter()
                assert self.read_handle.wait() == reading  # swap_in_optimizer_state: this sub-group's reads
                t1 = time.perf_counter()
                reading = self._swap_in(i + 1, self.sets[(i + 1) % 3]) if i + 1 < groups else 0  # async_parameter
                t2 = time.perf_counter()
                self._adam(i, bufs)
                t3 = time.perf_counter()
                if writing:  # swap_out_optimizer_state: complete the previous async swap-out first
                    assert self.write_handle.wait() == writing
                writing = self._swap_out(i, bufs)
                if i + 1 == groups:  # no next sub-group: the swap-out is synchronous
                    assert self.write_handle.wait() == writing
                    writing = 0
                t4 = time.perf_counter()
                read_wait += (t1 - t0) + (t2 - t1)
                compute += t3 - t2
                write_wait += t4 - t3
        self.phases["read_wait"].append(read_wait)
        self.phases["compute"].append(compute)
        self.phases["write_wait"].append(write_wait)

    def read_params(self) -> np.ndarray:
        """The params as the swap files hold them now (for checking the result)."""
        out = np.empty(self.numel, np.float32)
        buf = self.sets[0][0]
        for i, (start, numel, aligned) in enumerate(self.groups):
            assert self.read_handle.async_pread(buf.narrow(0, 0, aligned), self.paths[i][0], 0) == 0
            assert self.read_handle.wait() == 1
            out[start:start + numel] = buf[:numel].numpy()
        return out

    def describe(self) -> dict[str, Any]:
        arrangement = ("pipelined (PipelinedOptimizerSwapper)" if self.pipelined else
                       "serial (PartitionedOptimizerSwapper)")
        gradient = "swapped" if self.swap_gradient else "host memory, copied into the pinned gradient buffer"
        return {"arrangement": arrangement, "sub_groups": len(self.groups), "sub_group_numel": self.groups[0][1],
                "aio": dict(self.aio), "aio_handles": 2 if self.pipelined else 1,
                "pinned_buffer_bytes": sum(b.numel() * 4 for b in self._locked), "buffer_lock": self.lock_note,
                "gradient": gradient, "optimizer": "DeepSpeedCPUAdam (adamw_mode=False, fp32 state)"}

    def close(self) -> None:
        for b in self._locked:
            try:
                self.read_handle.free_cpu_locked_tensor(b)
            except Exception:  # noqa: BLE001  (best effort)
                pass
        self._locked = []
        self.sets = []
