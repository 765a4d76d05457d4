// The updater kernel: four processes in one DATAFLOW region, joined by FIFOs.
//
//   load       p, m, v in bursts from DDR                          -> ps, ms, vs    (II=1, one element per cycle)
//   gradient   dense fp32/bf16 passed through, or Top-K pairs
//              scattered into a 1024-element buffer per chunk      -> gs            (II=1 per element emitted)
//   update     Adam / AdamW / SGD(+momentum, Nesterov) / AdaGrad   -> po, mo, vo, p16o   (II=1, deep pipeline)
//   store      p, m, v (and the bf16 copy) back in bursts                           (II=1)
//
// The per-element arithmetic (UpdateElement) is ffi/kernels/kernel_portable.cc's PortableBlock in the same operation
// order, so C simulation -- and the hardware, whose fp32 cores round as IEEE-754 does -- matches nsp's CPU kernel bit
// for bit. Vitis HLS reads the pragmas; g++ ignores them (build with -Wno-unknown-pragmas). Loop labels name the loops
// in the synthesis reports (-Wno-unused-label under -Wall).
#include "backends/hls/nsp_updater_hls.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backends/hls/hls_stream_sim.h"

namespace {

// The coefficient block, unpacked into registers once per run.
struct Coeffs {
  float lr, mu_a, mu_b, nu_a, nu_b, inv_bc1, inv_bc2, eps, l2, decoupled_wd, momentum;
};

// The flags word, decoded once per run; every field is loop-invariant, so the loops carry no per-element control.
struct Mode {
  int kind;
  int grad;
  bool lazy, nesterov, momentum, bf16_out, use_m, use_v;
};

Mode DecodeFlags(uint32_t flags) {
  Mode mode;
  mode.kind = static_cast<int>(flags & NSP_HLS_FLAG_KIND_MASK);
  mode.grad = static_cast<int>((flags >> NSP_HLS_FLAG_GRAD_SHIFT) & NSP_HLS_FLAG_GRAD_MASK);
  mode.lazy = (flags & NSP_HLS_FLAG_LAZY) != 0;
  mode.nesterov = (flags & NSP_HLS_FLAG_NESTEROV) != 0;
  mode.momentum = (flags & NSP_HLS_FLAG_MOMENTUM) != 0;
  mode.bf16_out = (flags & NSP_HLS_FLAG_BF16_OUT) != 0;
  mode.use_m = mode.kind == NSP_HLS_ADAM || mode.kind == NSP_HLS_ADAMW || (mode.kind == NSP_HLS_SGD && mode.momentum);
  mode.use_v = mode.kind != NSP_HLS_SGD;
  return mode;
}

void ReadCoeffs(const float* words, Coeffs& c) {
  float w[NSP_HLS_NUM_COEFFS];
read_coeffs:
  for (int i = 0; i < NSP_HLS_NUM_COEFFS; ++i) {
#pragma HLS PIPELINE II=1
    w[i] = words[i];
  }
  c.lr = w[NSP_HLS_C_LR];
  c.mu_a = w[NSP_HLS_C_MU_A];
  c.mu_b = w[NSP_HLS_C_MU_B];
  c.nu_a = w[NSP_HLS_C_NU_A];
  c.nu_b = w[NSP_HLS_C_NU_B];
  c.inv_bc1 = w[NSP_HLS_C_INV_BC1];
  c.inv_bc2 = w[NSP_HLS_C_INV_BC2];
  c.eps = w[NSP_HLS_C_EPS];
  c.l2 = w[NSP_HLS_C_L2];
  c.decoupled_wd = w[NSP_HLS_C_DECOUPLED_WD];
  c.momentum = w[NSP_HLS_C_MOMENTUM];
}

// bf16 is the top half of an fp32: widening is a shift, no arithmetic.
float Bf16ToF32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even; a NaN stays a quiet NaN. The same rounding as the CPU kernel's bf16 param copy.
uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// ---- Stage 1: load ----

void LoadState(const float* p, const float* m, const float* v, int32_t n, bool use_m, bool use_v,
               hls::stream<float>& ps, hls::stream<float>& ms, hls::stream<float>& vs) {
load_state:
  for (int32_t i = 0; i < n; ++i) {
#pragma HLS PIPELINE II=1
    // Three ports on three AXI bundles: the three bursts run side by side, one element of each per cycle.
    ps.write(p[i]);
    if (use_m) ms.write(m[i]);
    if (use_v) vs.write(v[i]);
  }
}

// ---- Stage 2: gradient (pass-through or Top-K decompressor) ----

void DenseGradF32(const float* g, int32_t n, hls::stream<float>& gs) {
dense_f32:
  for (int32_t i = 0; i < n; ++i) {
#pragma HLS PIPELINE II=1
    gs.write(g[i]);
  }
}

void DenseGradBf16(const uint16_t* g, int32_t n, hls::stream<float>& gs) {
dense_bf16:
  for (int32_t i = 0; i < n; ++i) {
#pragma HLS PIPELINE II=1
    gs.write(Bf16ToF32(g[i]));
  }
}

// Scatters the sorted pairs chunk by chunk into `buf`, emits each chunk as a dense burst and clears it on the way
// out, so the buffer is all zeros again for the next chunk without a separate clearing pass.
void DecompressTopK(const float* vf, const uint16_t* vh, bool bf16, const int32_t* idx, int32_t n, int32_t count,
                    int32_t index_base, hls::stream<float>& gs) {
  float buf[NSP_HLS_CHUNK];
#pragma HLS BIND_STORAGE variable=buf type=ram_t2p impl=bram
clear_buf:
  for (int32_t i = 0; i < NSP_HLS_CHUNK; ++i) {
#pragma HLS PIPELINE II=1
    buf[i] = 0.0f;
  }
  // One pair is read ahead: the first pair past a chunk waits in registers for the next chunk, so every index
  // and value is read exactly once, in order (sequential reads the m_axi adapter turns into bursts).
  int32_t j = 0;
  bool pending = false;
  int32_t pk = 0;
  float pv = 0.0f;
chunks:
  for (int32_t c0 = 0; c0 < n; c0 += NSP_HLS_CHUNK) {
    const int32_t len = n - c0 < NSP_HLS_CHUNK ? n - c0 : NSP_HLS_CHUNK;
  scatter:
    for (;;) {
      // Not II=1: buf[k] = buf[k] + v is a read-add-write recurrence when an index repeats, so the loop runs at the
      // adder's latency per pair. At 1% density that is ~0.05 cycles per emitted element.
#pragma HLS PIPELINE
      if (!pending) {
        if (j >= count) break;
        pk = idx[j] - index_base;
        pv = bf16 ? Bf16ToF32(vh[j]) : vf[j];
        ++j;
        pending = true;
      }
      if (pk >= c0 + len) break;
      // Indices were checked by the host (nsp_hls_check_topk); the mask only keeps a bad one inside the buffer.
      const int32_t k = (pk - c0) & (NSP_HLS_CHUNK - 1);
      buf[k] = buf[k] + pv;  // from 0.0f, in index order: the CPU kernel's scatter-add, operation for operation
      pending = false;
    }
  emit:
    for (int32_t i = 0; i < len; ++i) {
#pragma HLS PIPELINE II=1
      gs.write(buf[i]);
      buf[i] = 0.0f;
    }
  }
}

void GradStage(const float* gf, const uint16_t* gh, const int32_t* idx, int32_t n, int32_t count, int32_t index_base,
               int grad, hls::stream<float>& gs) {
  if (grad == NSP_HLS_GRAD_F32) DenseGradF32(gf, n, gs);
  else if (grad == NSP_HLS_GRAD_BF16) DenseGradBf16(gh, n, gs);
  else DecompressTopK(gf, gh, grad == NSP_HLS_TOPK_BF16, idx, n, count, index_base, gs);
}

// ---- Stage 3: update ----

// One element: PortableBlock's arithmetic (ffi/kernels/kernel_portable.cc) in its order. Returns p, m, v through
// references; m and v pass through unchanged for kinds that do not keep them.
void UpdateElement(const Coeffs& c, const Mode& mode, float g, float p, float m_in, float v_in, float& p_out,
                   float& m_out, float& v_out) {
  m_out = m_in;
  v_out = v_in;
  if (mode.lazy && g == 0.0f) {  // a lazy update leaves elements without gradient as they are
    p_out = p;
    return;
  }
  float update;  // the step is p <- p - lr * update
  if (mode.kind == NSP_HLS_ADAM || mode.kind == NSP_HLS_ADAMW) {
    if (mode.kind == NSP_HLS_ADAM && c.l2 != 0.0f) g += c.l2 * p;
    const float m = c.mu_a * m_in + c.mu_b * g;
    const float v = c.nu_a * v_in + c.nu_b * g * g;
    update = (m * c.inv_bc1) / (std::sqrt(v * c.inv_bc2) + c.eps);
    if (mode.kind == NSP_HLS_ADAMW) update += c.decoupled_wd * p;
    m_out = m;
    v_out = v;
  } else if (mode.kind == NSP_HLS_SGD) {
    if (c.l2 != 0.0f) g += c.l2 * p;
    update = g;
    if (mode.momentum) {
      const float m = c.momentum * m_in + g;
      m_out = m;
      update = mode.nesterov ? g + c.momentum * m : m;
    }
  } else {
    if (c.l2 != 0.0f) g += c.l2 * p;
    const float v = v_in + g * g;
    update = v > 0.0f ? g / std::sqrt(v + c.eps) : 0.0f;
    v_out = v;
  }
  p_out = p - c.lr * update;
}

void UpdateStage(const Coeffs& c, const Mode& mode, int32_t n, hls::stream<float>& ps, hls::stream<float>& ms,
                 hls::stream<float>& vs, hls::stream<float>& gs, hls::stream<float>& po, hls::stream<float>& mo,
                 hls::stream<float>& vo, hls::stream<uint16_t>& p16o) {
update:
  for (int32_t i = 0; i < n; ++i) {
#pragma HLS PIPELINE II=1
    const float g = gs.read();
    const float p = ps.read();
    const float m_in = mode.use_m ? ms.read() : 0.0f;
    const float v_in = mode.use_v ? vs.read() : 0.0f;
    float p_new, m_new, v_new;
    UpdateElement(c, mode, g, p, m_in, v_in, p_new, m_new, v_new);
    po.write(p_new);
    if (mode.use_m) mo.write(m_new);
    if (mode.use_v) vo.write(v_new);
    if (mode.bf16_out) p16o.write(F32ToBf16(p_new));
  }
}

// ---- Stage 4: store ----

void StoreState(float* p, float* m, float* v, uint16_t* p16, int32_t n, const Mode& mode, hls::stream<float>& po,
                hls::stream<float>& mo, hls::stream<float>& vo, hls::stream<uint16_t>& p16o) {
store_state:
  for (int32_t i = 0; i < n; ++i) {
#pragma HLS PIPELINE II=1
    p[i] = po.read();
    if (mode.use_m) m[i] = mo.read();
    if (mode.use_v) v[i] = vo.read();
    if (mode.bf16_out) p16[i] = p16o.read();
  }
}

void UpdatePage(const float* p_in, const float* m_in, const float* v_in, float* p_out, float* m_out, float* v_out,
                uint16_t* p16_out, const float* grad_f32, const uint16_t* grad_bf16, const int32_t* topk_idx,
                const Coeffs& c, const Mode& mode, int32_t n, int32_t topk_count, int32_t index_base) {
#pragma HLS DATAFLOW
  // Input FIFOs hold a whole chunk: while the decompressor scatters a chunk's pairs (no gradient out), the load
  // stage keeps bursting p, m, v into them instead of stalling the DDR reads.
  hls::stream<float> ps("p_in"), ms("m_in"), vs("v_in"), gs("grad");
  hls::stream<float> po("p_out"), mo("m_out"), vo("v_out");
  hls::stream<uint16_t> p16o("p_bf16_out");
#pragma HLS STREAM variable=ps depth=1024
#pragma HLS STREAM variable=ms depth=1024
#pragma HLS STREAM variable=vs depth=1024
#pragma HLS STREAM variable=gs depth=64
#pragma HLS STREAM variable=po depth=64
#pragma HLS STREAM variable=mo depth=64
#pragma HLS STREAM variable=vo depth=64
#pragma HLS STREAM variable=p16o depth=64
  LoadState(p_in, m_in, v_in, n, mode.use_m, mode.use_v, ps, ms, vs);
  GradStage(grad_f32, grad_bf16, topk_idx, n, topk_count, index_base, mode.grad, gs);
  UpdateStage(c, mode, n, ps, ms, vs, gs, po, mo, vo, p16o);
  StoreState(p_out, m_out, v_out, p16_out, n, mode, po, mo, vo, p16o);
#ifndef __SYNTHESIS__
  // C simulation only: every FIFO drained means each producer and its consumer agreed on the element count.
  if (!ps.empty() || !ms.empty() || !vs.empty() || !gs.empty() || !po.empty() || !mo.empty() || !vo.empty() ||
      !p16o.empty()) {
    std::abort();
  }
#endif
}

}  // namespace

extern "C" void nsp_update_page(const float* p_in, const float* m_in, const float* v_in, float* p_out, float* m_out,
                                float* v_out, uint16_t* p_bf16_out, const float* grad_f32, const uint16_t* grad_bf16,
                                const int32_t* topk_idx, const float* coeffs, int32_t n, int32_t topk_count,
                                int32_t index_base, uint32_t flags) {
  // Inputs and outputs on separate bundles: an in-place update binds one buffer to both, and the load and store
  // stages then stream it through the adapter's independent read and write channels.
#pragma HLS INTERFACE m_axi port=p_in offset=slave bundle=gmem_p_in max_read_burst_length=64 depth=4096
#pragma HLS INTERFACE m_axi port=m_in offset=slave bundle=gmem_m_in max_read_burst_length=64 depth=4096
#pragma HLS INTERFACE m_axi port=v_in offset=slave bundle=gmem_v_in max_read_burst_length=64 depth=4096
#pragma HLS INTERFACE m_axi port=p_out offset=slave bundle=gmem_p_out max_write_burst_length=64 depth=4096
#pragma HLS INTERFACE m_axi port=m_out offset=slave bundle=gmem_m_out max_write_burst_length=64 depth=4096
#pragma HLS INTERFACE m_axi port=v_out offset=slave bundle=gmem_v_out max_write_burst_length=64 depth=4096
#pragma HLS INTERFACE m_axi port=p_bf16_out offset=slave bundle=gmem_p16 max_write_burst_length=64 depth=4096
#pragma HLS INTERFACE m_axi port=grad_f32 offset=slave bundle=gmem_grad max_read_burst_length=64 depth=4096
#pragma HLS INTERFACE m_axi port=grad_bf16 offset=slave bundle=gmem_grad max_read_burst_length=64 depth=4096
#pragma HLS INTERFACE m_axi port=topk_idx offset=slave bundle=gmem_idx max_read_burst_length=64 depth=4096
#pragma HLS INTERFACE m_axi port=coeffs offset=slave bundle=gmem_coeffs max_read_burst_length=16 depth=16
#pragma HLS INTERFACE s_axilite port=p_in
#pragma HLS INTERFACE s_axilite port=m_in
#pragma HLS INTERFACE s_axilite port=v_in
#pragma HLS INTERFACE s_axilite port=p_out
#pragma HLS INTERFACE s_axilite port=m_out
#pragma HLS INTERFACE s_axilite port=v_out
#pragma HLS INTERFACE s_axilite port=p_bf16_out
#pragma HLS INTERFACE s_axilite port=grad_f32
#pragma HLS INTERFACE s_axilite port=grad_bf16
#pragma HLS INTERFACE s_axilite port=topk_idx
#pragma HLS INTERFACE s_axilite port=coeffs
#pragma HLS INTERFACE s_axilite port=n
#pragma HLS INTERFACE s_axilite port=topk_count
#pragma HLS INTERFACE s_axilite port=index_base
#pragma HLS INTERFACE s_axilite port=flags
#pragma HLS INTERFACE s_axilite port=return
  if (n <= 0) return;
  Coeffs c;
  ReadCoeffs(coeffs, c);
  const Mode mode = DecodeFlags(flags);
  UpdatePage(p_in, m_in, v_in, p_out, m_out, v_out, p_bf16_out, grad_f32, grad_bf16, topk_idx, c, mode, n,
             topk_count, index_base);
}
