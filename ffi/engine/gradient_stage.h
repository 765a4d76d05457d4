// GradientStage: one store shard's gradient, staged in a file beside the shard's pages while the backward pass
// runs, so that a step never holds the whole gradient in memory (Smart-Infinity's flow: gradients go down to
// the storage that holds the optimizer state, and the update runs there).
//
// The file holds the shard's elements end to end in the gradient's dtype. Each gradient leaf is written at its
// place as soon as the backward pass has produced it (the leaf's memory is then free); the update reads the
// file a page at a time and writes each page's new params over that page's gradient (ShardPieces::stage); the
// step then reads the new params back a leaf at a time. Positional reads and writes: any thread, any order.
// Nothing here is made durable unless Sync is called: a two-slot store's crash loses only a step that never
// committed, whose gradient is recomputed; a one-slot store syncs it before its redo journal names it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace nsp {

class GradientStage {
 public:
  // Opens (creating it if absent) the stage file at `path`; returns "" or an error naming the file.
  static std::string Open(const std::string& path, std::unique_ptr<GradientStage>* out);
  ~GradientStage();
  GradientStage(const GradientStage&) = delete;
  GradientStage& operator=(const GradientStage&) = delete;

  // Writes `n` elements of `elem_bytes` each from `src` at element `at`; reads them back into `dst`. A read
  // past what was written is an error (a leaf that was never staged), not zeros.
  std::string Write(int64_t at, const void* src, int64_t n, int64_t elem_bytes) const;
  std::string Read(int64_t at, void* dst, int64_t n, int64_t elem_bytes) const;
  // Makes what was written durable (a one-slot store's redo journal refers to the staged gradient); "" or an
  // error naming the file.
  std::string Sync() const;
  // The file's size in bytes (-1 when it cannot be told).
  int64_t Bytes() const;
  const std::string& path() const { return path_; }

 private:
  GradientStage(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_;
  std::string path_;
};

}  // namespace nsp
