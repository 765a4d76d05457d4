// One update of the engine's shard (ShardEngine::Update): checks it, runs it in place when the backend's state is
// addressable (one kernel pass over the slots, or piece by piece, or page by page from the caller's params) or
// hands it to the streamed pipeline (store_engine_stream.cc), and counts its traffic. Also where each page's
// gradient and caller params come from.
#include <algorithm>
#include <cstring>
#include <string>

#include "engine/store_engine.h"

namespace nsp {

int ShardEngine::CountStates(const std::array<bool, kNumStates>& states) {
  int count = 0;
  for (bool s : states) count += s ? 1 : 0;
  return count;
}

bool ShardEngine::Addressable() const {
  for (int s = 0; s < kNumStates; ++s) {
    if (used_[s] && (backend_->PageAddress(0, s, 0) == nullptr || backend_->PageAddress(1, s, 0) == nullptr)) {
      return false;
    }
  }
  return true;
}

// The shared link's bytes, counted where the engine consumes a gradient span (dense elements, or compressed
// pairs) and hands out its params (fp32, bf16, or into the gradient's pieces).
// The caller's params, when the step starts from them, count as coming down the link too.
void ShardEngine::CountShared(const ShardUpdate& u, const PageGrad& g, int64_t elems, const StateSpan& span) {
  const int64_t gbytes = GradBytes(g.type);
  stats_.shared_in_bytes += g.dense != nullptr ? elems * gbytes : g.count * (gbytes + 4);
  if (u.params_in != nullptr) stats_.shared_in_bytes += elems * GradBytes(u.params_in->type);
  if (u.pieces != nullptr) stats_.shared_out_bytes += elems * gbytes;
  if (span.param_copy_out != nullptr) stats_.shared_out_bytes += span.size * 4;
  if (span.param_bf16_out != nullptr) stats_.shared_out_bytes += span.size * 2;
}

// The internal link's bytes when the state is addressable: what the kernel pass read and wrote in place.
void ShardEngine::CountInPlace(int64_t elems, bool param_read) {
  const int states = CountStates(used_);
  stats_.internal_read_bytes += (states - (param_read ? 0 : 1)) * elems * 4;
  stats_.internal_write_bytes += states * elems * 4;
}

char* ShardEngine::GradStage() {
  if (grad_stage_.data == nullptr) grad_stage_ = AlignedBuffer(sizeof(float) * static_cast<size_t>(page_elems_));
  return reinterpret_cast<char*>(grad_stage_.data);
}

const float* ShardEngine::CallerParams(const ShardUpdate& u, int64_t begin, int64_t n) {
  if (params_stage_.data == nullptr) params_stage_ = AlignedBuffer(sizeof(float) * static_cast<size_t>(page_elems_));
  u.params_in->Gather(begin, n, params_stage_.data);
  return params_stage_.data;
}

std::string ShardEngine::GradForPage(const ShardUpdate& u, int64_t page, PageGrad* out) {
  PageGrad& g = *out;
  g = PageGrad{};
  g.type = u.grad_type;
  const int64_t begin = page * page_elems_;
  if (u.pieces != nullptr) {  // gather this page's gradient from the leaves it spans (or from its stage file)
    char* stage = GradStage();
    g.dense = stage;
    return u.pieces->GatherGrad(begin, std::min(page_elems_, size_ - begin), stage);
  }
  if (u.grad != nullptr) {
    g.dense = static_cast<const char*>(u.grad) + begin * GradBytes(u.grad_type);
    return {};
  }
  // Pages may arrive in any order: find this page's run of the sorted indices.
  const int64_t end = std::min(begin + page_elems_, size_);
  const int64_t lo = std::lower_bound(u.indices, u.indices + u.count, begin) - u.indices;
  const int64_t hi = std::lower_bound(u.indices + lo, u.indices + u.count, end) - u.indices;
  g.indices = u.indices + lo;
  g.values = static_cast<const char*>(u.values) + lo * GradBytes(u.grad_type);
  g.count = hi - lo;
  g.index_base = begin;
  return {};
}

bool ShardEngine::ComputeChecked(const ShardUpdate& u, const StateSpan& span, const PageGrad& g) {
  if (!u.check_finite) {
    backend_->Compute(u.hp, span, g);
    return true;
  }
  return backend_->ComputeIfFinite(u.hp, span, g.dense, g.type);
}

std::string ShardEngine::Update(const ShardUpdate& u) {
  if (u.src_slot == u.dst_slot || u.src_slot < 0 || u.src_slot > 1 || u.dst_slot < 0 || u.dst_slot > 1) {
    return "an update must read one version slot and write the other";
  }
  if (u.pieces != nullptr && u.pieces->type != u.grad_type) return "internal error: pieces and gradient types differ";
  if (u.grad == nullptr && u.pieces == nullptr) {
    if (std::string err = ValidateSparseIndices(u.indices, u.count, size_); !err.empty()) return err;
  }
  if (u.first_page < 0 || u.first_page >= num_pages_ || (u.end_page >= 0 && (u.end_page <= u.first_page ||
                                                                              u.end_page > num_pages_))) {
    return "internal error: an update's pages are not a range of the shard's";
  }
  if ((u.first_page != 0 || u.end_page >= 0) && Addressable()) {
    return "internal error: only a streamed update covers part of a shard";
  }
  if (u.check_finite &&
      ((u.pieces == nullptr && u.grad == nullptr) || u.skipped == nullptr || !ChecksFiniteInPass() || u.params_in)) {
    return "internal error: an in-pass finiteness check needs a dense gradient (or pieces), a skipped flag and a "
           "two-slot store, stepping from its own params";
  }
  const IoCounts before = backend_->Io();
  std::string err = !Addressable()            ? UpdateStreamed(u)
                    : u.params_in != nullptr ? UpdateAddressableFromCaller(u)
                                             : UpdateAddressable(u);
  // What the backend's I/O moved during the update (each call's return value), failed or not.
  const IoCounts after = backend_->Io();
  stats_.internal_read_bytes += after.read_bytes - before.read_bytes;
  stats_.internal_write_bytes += after.write_bytes - before.write_bytes;
  stats_.pages_read += after.pages_read - before.pages_read;
  stats_.pages_written += after.pages_written - before.pages_written;
  stats_.pages_read_direct += after.pages_read_direct - before.pages_read_direct;
  if (Addressable() && err.empty()) {  // every page of every state was passed over in place
    const int states = CountStates(used_);
    stats_.pages_read += states * num_pages_;
    stats_.pages_written += states * num_pages_;
  }
  // A one-slot step updates its shard a window at a time: counted once, at its first window.
  if (err.empty() && !(u.check_finite && *u.skipped) && u.first_page == 0) stats_.updates += 1;
  return err;
}

StateSpan ShardEngine::SlotSpan(const ShardUpdate& u, int64_t begin, int64_t n) const {
  StateSpan span;
  span.size = n;
  span.param_in = backend_->PageAddress(u.src_slot, kParamState, 0) + begin;
  span.param_out = backend_->PageAddress(u.dst_slot, kParamState, 0) + begin;
  if (used_[kMuState]) {
    span.mu_in = backend_->PageAddress(u.src_slot, kMuState, 0) + begin;
    span.mu_out = backend_->PageAddress(u.dst_slot, kMuState, 0) + begin;
  }
  if (used_[kNuState]) {
    span.nu_in = backend_->PageAddress(u.src_slot, kNuState, 0) + begin;
    span.nu_out = backend_->PageAddress(u.dst_slot, kNuState, 0) + begin;
  }
  return span;
}

std::string ShardEngine::UpdateAddressable(const ShardUpdate& u) {
  if (u.pieces != nullptr) {
    // Piece by piece, with no copies: the kernel reads each piece's gradient where it lies and writes the new
    // params over it (element by element, each read before its write), while updating the slots.
    const ShardPieces& pieces = *u.pieces;
    int64_t end = 0;
    for (size_t i = 0; i < pieces.sizes.size(); ++i) {
      StateSpan span = SlotSpan(u, pieces.starts[i], pieces.sizes[i]);
      if (pieces.type == GradType::kF32) {
        span.param_copy_out = static_cast<float*>(pieces.out[i]);
      } else {
        span.param_bf16_out = static_cast<uint16_t*>(pieces.out[i]);
      }
      PageGrad g;
      g.type = pieces.type;
      g.dense = pieces.grad[i];
      CountShared(u, g, pieces.sizes[i], StateSpan{});
      CountInPlace(pieces.sizes[i], true);
      if (!ComputeChecked(u, span, g)) {
        *u.skipped = true;  // slot dst is half written and stays uncommitted: Step skips the step
        return {};
      }
      end = pieces.starts[i] + pieces.sizes[i];
    }
    // The shard's padding past the last piece: a zero gradient (it keeps its zeros), a page at a time.
    for (int64_t begin = end; begin < size_; begin += page_elems_) {
      const int64_t n = std::min(page_elems_, size_ - begin);
      PageGrad g;
      g.type = pieces.type;
      char* stage = GradStage();
      std::memset(stage, 0, static_cast<size_t>(n * GradBytes(pieces.type)));
      g.dense = stage;
      CountInPlace(n, true);
      backend_->Compute(u.hp, SlotSpan(u, begin, n), g);
    }
    PageDone(num_pages_);  // one pass over the whole shard, piece by piece
    return {};
  }
  StateSpan span = SlotSpan(u, 0, size_);
  span.param_copy_out = u.params_out;
  span.param_bf16_out = u.params_bf16_out;
  PageGrad g;
  g.type = u.grad_type;
  g.dense = u.grad;
  g.indices = u.indices;
  g.values = u.values;
  g.count = u.count;
  CountShared(u, g, size_, span);
  CountInPlace(size_, true);
  if (!ComputeChecked(u, span, g)) {
    *u.skipped = true;  // slot dst is half written and stays uncommitted: Step skips the step
    return {};
  }
  PageDone(num_pages_);  // one pass over the whole shard
  return {};
}

std::string ShardEngine::UpdateAddressableFromCaller(const ShardUpdate& u) {
  for (int64_t begin = 0; begin < size_; begin += page_elems_) {
    const int64_t n = std::min(page_elems_, size_ - begin);
    StateSpan span = SlotSpan(u, begin, n);
    span.param_in = CallerParams(u, begin, n);
    if (u.params_out != nullptr) span.param_copy_out = u.params_out + begin;
    if (u.params_bf16_out != nullptr) span.param_bf16_out = u.params_bf16_out + begin;
    PageGrad g;
    if (std::string e = GradForPage(u, begin / page_elems_, &g); !e.empty()) return e;
    CountShared(u, g, ShardPieces::Covered(u.pieces, begin, n), span);
    CountInPlace(n, false);
    backend_->Compute(u.hp, span, g);
    if (u.pieces != nullptr) {
      if (std::string e = u.pieces->ScatterParams(begin, n, span.param_out); !e.empty()) return e;
    }
    PageDone();
  }
  return {};
}

}  // namespace nsp
