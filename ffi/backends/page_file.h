// Page files on a local file system, the file tier's unit of storage: whole-file vectored reads and writes that
// retry short transfers, dropping a file from the page cache, the group-committed syncfs a commit waits for, and
// the error messages that name a page file. Nothing here knows slots, states or checksums: the file backend
// (file_backend.cc) lays its pages out on top of these.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <string>

namespace nsp::page_file {

constexpr size_t kAlign = 4096;  // O_DIRECT alignment of buffers, offsets and sizes
inline size_t RoundUp(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
// The bytes of a file of `bytes` that fill whole blocks: what direct I/O can move of it.
inline size_t WholeBlocks(size_t bytes) { return bytes / kAlign * kAlign; }

// The most bytes one read or write call asks for: a 4 MiB page moves as four 1 MiB requests, one after another
// on the calling thread. On the virtual disk of bench/store_update.py's records, whose host serves several
// requests at once, the file tier's update (6 readers, 8 writers, 4 MiB pages) took 0.91x the time this way
// (interleaved runs, five rounds each, 4 pairs: 212-227 ms against 228-244 ms); 2 MiB requests were no faster
// than 4 MiB. A local NVMe disk's block layer cuts larger requests to about this size anyway.
constexpr size_t kMaxRequestBytes = size_t{1} << 20;

// Read or write all of `iov` at the file's offset in calls of at most kMaxRequestBytes, retrying short transfers
// and EINTR; return the bytes moved (fewer than asked only at the end of the file), or -1 with errno set.
ssize_t ReadAll(int fd, iovec* iov, int count);
ssize_t WriteAll(int fd, iovec* iov, int count);

// Turns O_DIRECT off on `fd`, so that a file's partial last block (which direct I/O cannot move on its own)
// goes through the page cache. Returns false, errno set, when the flag cannot be changed.
bool StopDirect(int fd);

// Drops a page file of `file_bytes` from the page cache, except its last, partial block (the checksum trailer):
// rewriting that block in place would otherwise read it back from disk first, one small synchronous read per
// page file queued behind the update's page reads (it tripled the writer's time here). Kept, it costs 4 KiB of
// cache per page file.
void DropFromCache(int fd, size_t file_bytes);

// Makes everything written on the file system holding `dir` durable (data and renames' metadata). Shards on
// one file system that commit together share one flush. Returns "" or an error naming `dir`.
std::string GroupSync(const std::string& dir);

// Renames the finished temporary file `tmp` over `path` (atomic on a local file system: readers see the old
// file or the new one); on failure removes `tmp`. Returns "" or an error naming `path`.
std::string RenameInto(const std::string& tmp, const std::string& path);

// "<what> <path>: <errno's text>".
std::string ErrnoMessage(const std::string& what, const std::string& path);
// A page file that is absent: never zeros (as zarr reads an absent chunk), since every version the engine
// reads had all its pages written.
std::string MissingMessage(const std::string& path);
// A page file shorter than its page.
std::string TruncatedMessage(const std::string& path, ssize_t got, size_t expected);

}  // namespace nsp::page_file
