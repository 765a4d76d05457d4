// slow_disk: a FUSE file system that passes every file through to a directory on the real disk, but serves the
// bytes no faster than a slow disk would. A bench tool (bench/slow_disk.py builds and mounts it), not part of nsp.
//
// The disk it imitates serves reads and writes from one budget, as an SSD's flash and controller do: every request
// takes its place on one timeline and occupies it for bytes / rate (the read rate for reads, the write rate for
// writes), first come first served, whatever the queue depth. A request returns once its slot on the timeline has
// passed (or once the real I/O is done, if that is later). So reads and writes do not add up to more than the disk
// has, unlike a cgroup throttle, whose read and write budgets are separate.
//
// Files are opened with direct_io, so the kernel keeps no page cache for them above this file system: every read
// an application makes, buffered or O_DIRECT, reaches the timeline, as it would on a disk with a cold cache. The
// directory underneath is read and written buffered; its page cache only makes the real I/O fast enough not to
// matter next to the timeline (bench/slow_disk.py puts it on tmpfs, so it costs no disk time at all). fsync is
// passed through.
//
// The mount serves one more file, /.slow_disk_stat (not listed, read-only): the emulated disk's counters in the
// format of Linux's /sys/block/<dev>/stat (requests, 512-byte sectors and busy milliseconds at the same field
// positions), so a benchmark reads them as it reads a block device's. Busy time is the time booked on the
// timeline: since requests never overlap there, it is their sum.
//
//   slow_disk BACKING_DIR READ_GBPS WRITE_GBPS MOUNTPOINT [FUSE options, e.g. -f]
//
// GB/s are decimal (1e9 bytes). Unmount with `fusermount3 -u MOUNTPOINT`.

#define FUSE_USE_VERSION 35
#define _GNU_SOURCE

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static int backing_fd = -1;       // the directory underneath, every path is resolved against it
static double read_ns_per_byte;   // 1 / read rate
static double write_ns_per_byte;  // 1 / write rate

static pthread_mutex_t timeline_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t timeline_free_ns;  // when the disk finishes the requests already given to it
static uint64_t bytes_read, bytes_written, requests_read, requests_written, busy_ns;

#define STAT_PATH "/.slow_disk_stat"
#define STAT_FH UINT64_MAX  // the file handle of an open stat file: no file underneath

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

// Books `bytes` on the timeline; returns when the disk would have finished them.
static uint64_t book(size_t bytes, int is_write) {
  double ns = (double)bytes * (is_write ? write_ns_per_byte : read_ns_per_byte);
  pthread_mutex_lock(&timeline_lock);
  uint64_t start = now_ns();
  if (timeline_free_ns > start) start = timeline_free_ns;
  uint64_t done = start + (uint64_t)ns;
  timeline_free_ns = done;
  busy_ns += (uint64_t)ns;
  if (is_write) {
    bytes_written += bytes;
    requests_written++;
  } else {
    bytes_read += bytes;
    requests_read++;
  }
  pthread_mutex_unlock(&timeline_lock);
  return done;
}

static void wait_until(uint64_t done) {
  uint64_t t = now_ns();
  if (t >= done) return;
  uint64_t left = done - t;
  struct timespec ts = {(time_t)(left / 1000000000ull), (long)(left % 1000000000ull)};
  while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
  }
}

static const char* rel(const char* path) { return path[1] ? path + 1 : "."; }

static int is_stat(const char* path) { return strcmp(path, STAT_PATH) == 0; }

// The counters as /sys/block/<dev>/stat lays them out: reads, merges, sectors, ms, writes, merges, sectors, ms,
// in flight, busy ms, weighted ms. Fields this disk has no notion of are 0.
static int format_stat(char* buf, size_t size) {
  pthread_mutex_lock(&timeline_lock);
  int n = snprintf(buf, size, "%llu 0 %llu 0 %llu 0 %llu 0 0 %llu 0\n", (unsigned long long)requests_read,
                   (unsigned long long)(bytes_read / 512), (unsigned long long)requests_written,
                   (unsigned long long)(bytes_written / 512), (unsigned long long)(busy_ns / 1000000));
  pthread_mutex_unlock(&timeline_lock);
  return n;
}

static int sd_getattr(const char* path, struct stat* st, struct fuse_file_info* fi) {
  if (is_stat(path)) {
    memset(st, 0, sizeof *st);
    st->st_mode = S_IFREG | 0444;
    st->st_nlink = 1;
    st->st_size = 4096;  // more than the text; reads end where it does
    return 0;
  }
  int r = fi ? fstat((int)fi->fh, st) : fstatat(backing_fd, rel(path), st, AT_SYMLINK_NOFOLLOW);
  return r == -1 ? -errno : 0;
}

static int sd_readdir(const char* path, void* buf, fuse_fill_dir_t fill, off_t off, struct fuse_file_info* fi,
                      enum fuse_readdir_flags flags) {
  (void)off, (void)fi, (void)flags;
  int fd = openat(backing_fd, rel(path), O_RDONLY | O_DIRECTORY);
  if (fd == -1) return -errno;
  DIR* dir = fdopendir(fd);
  if (!dir) {
    close(fd);
    return -errno;
  }
  struct dirent* e;
  while ((e = readdir(dir)) != NULL) {
    struct stat st = {0};
    st.st_ino = e->d_ino;
    st.st_mode = (mode_t)(e->d_type << 12);
    if (fill(buf, e->d_name, &st, 0, 0)) break;
  }
  closedir(dir);
  return 0;
}

static int sd_open(const char* path, struct fuse_file_info* fi) {
  if (is_stat(path)) {
    if ((fi->flags & O_ACCMODE) != O_RDONLY) return -EACCES;
    fi->fh = STAT_FH;
    fi->direct_io = 1;
    return 0;
  }
  // O_DIRECT is not passed down: the timeline is the disk; the real one underneath only has to keep up.
  int fd = openat(backing_fd, rel(path), fi->flags & ~O_DIRECT);
  if (fd == -1) return -errno;
  fi->fh = (uint64_t)fd;
  fi->direct_io = 1;
  return 0;
}

static int sd_create(const char* path, mode_t mode, struct fuse_file_info* fi) {
  int fd = openat(backing_fd, rel(path), (fi->flags & ~O_DIRECT) | O_CREAT, mode);
  if (fd == -1) return -errno;
  fi->fh = (uint64_t)fd;
  fi->direct_io = 1;
  return 0;
}

// Moves all `size` bytes at `off` between `fd` and `buf` (written when `write`, else read), again after a signal;
// a read ends early at the end of the file. Returns the bytes moved, or -errno.
static ssize_t transfer(int fd, char* buf, size_t size, off_t off, int write) {
  size_t moved = 0;
  while (moved < size) {
    ssize_t n = write ? pwrite(fd, buf + moved, size - moved, off + (off_t)moved)
                      : pread(fd, buf + moved, size - moved, off + (off_t)moved);
    if (n == -1) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (n == 0) break;
    moved += (size_t)n;
  }
  return (ssize_t)moved;
}

static int sd_read(const char* path, char* buf, size_t size, off_t off, struct fuse_file_info* fi) {
  (void)path;
  if (fi->fh == STAT_FH) {  // served from the counters, not booked on the timeline
    char text[256];
    int n = format_stat(text, sizeof text);
    if (off >= n) return 0;
    size_t len = (size_t)(n - off) < size ? (size_t)(n - off) : size;
    memcpy(buf, text + off, len);
    return (int)len;
  }
  uint64_t done = book(size, 0);
  ssize_t got = transfer((int)fi->fh, buf, size, off, 0);
  if (got < 0) return (int)got;
  wait_until(done);
  return (int)got;
}

static int sd_write(const char* path, const char* buf, size_t size, off_t off, struct fuse_file_info* fi) {
  (void)path;
  uint64_t done = book(size, 1);
  ssize_t put = transfer((int)fi->fh, (char*)buf, size, off, 1);
  if (put < 0) return (int)put;
  wait_until(done);
  return (int)put;
}

static int sd_release(const char* path, struct fuse_file_info* fi) {
  (void)path;
  if (fi->fh != STAT_FH) close((int)fi->fh);
  return 0;
}

static int sd_fsync(const char* path, int datasync, struct fuse_file_info* fi) {
  (void)path;
  int r = datasync ? fdatasync((int)fi->fh) : fsync((int)fi->fh);
  return r == -1 ? -errno : 0;
}

static int sd_fsyncdir(const char* path, int datasync, struct fuse_file_info* fi) {
  (void)datasync, (void)fi;
  int fd = openat(backing_fd, rel(path), O_RDONLY | O_DIRECTORY);
  if (fd == -1) return -errno;
  int r = fsync(fd);
  int err = errno;
  close(fd);
  return r == -1 ? -err : 0;
}

static int sd_truncate(const char* path, off_t size, struct fuse_file_info* fi) {
  int r;
  if (fi) {
    r = ftruncate((int)fi->fh, size);
  } else {
    int fd = openat(backing_fd, rel(path), O_WRONLY);
    if (fd == -1) return -errno;
    r = ftruncate(fd, size);
    int err = errno;
    close(fd);
    errno = err;
  }
  return r == -1 ? -errno : 0;
}

static int sd_fallocate(const char* path, int mode, off_t off, off_t len, struct fuse_file_info* fi) {
  (void)path;
  return fallocate((int)fi->fh, mode, off, len) == -1 ? -errno : 0;
}

static int sd_mkdir(const char* path, mode_t mode) {
  return mkdirat(backing_fd, rel(path), mode) == -1 ? -errno : 0;
}
static int sd_rmdir(const char* path) { return unlinkat(backing_fd, rel(path), AT_REMOVEDIR) == -1 ? -errno : 0; }
static int sd_unlink(const char* path) { return unlinkat(backing_fd, rel(path), 0) == -1 ? -errno : 0; }

static int sd_rename(const char* from, const char* to, unsigned int flags) {
  return renameat2(backing_fd, rel(from), backing_fd, rel(to), flags) == -1 ? -errno : 0;
}

static int sd_link(const char* from, const char* to) {
  return linkat(backing_fd, rel(from), backing_fd, rel(to), 0) == -1 ? -errno : 0;
}

static int sd_symlink(const char* target, const char* path) {
  return symlinkat(target, backing_fd, rel(path)) == -1 ? -errno : 0;
}

static int sd_readlink(const char* path, char* buf, size_t size) {
  ssize_t n = readlinkat(backing_fd, rel(path), buf, size - 1);
  if (n == -1) return -errno;
  buf[n] = '\0';
  return 0;
}

static int sd_chmod(const char* path, mode_t mode, struct fuse_file_info* fi) {
  int r = fi ? fchmod((int)fi->fh, mode) : fchmodat(backing_fd, rel(path), mode, 0);
  return r == -1 ? -errno : 0;
}

static int sd_utimens(const char* path, const struct timespec tv[2], struct fuse_file_info* fi) {
  int r = fi ? futimens((int)fi->fh, tv) : utimensat(backing_fd, rel(path), tv, AT_SYMLINK_NOFOLLOW);
  return r == -1 ? -errno : 0;
}

static int sd_statfs(const char* path, struct statvfs* st) {
  (void)path;
  return fstatvfs(backing_fd, st) == -1 ? -errno : 0;
}

static void* sd_init(struct fuse_conn_info* conn, struct fuse_config* cfg) {
  // Requests of up to 1 MiB (the kernel's own limit is 256 pages), as a real disk's queue would take them.
  conn->max_write = 1u << 20;
  conn->max_readahead = 1u << 20;
  conn->max_background = 64;
  conn->congestion_threshold = 48;
  cfg->use_ino = 1;
  cfg->direct_io = 1;
  // Names and attributes stay cached in the kernel, as a local file system's dentries and inodes do: every change
  // goes through this mount, which keeps them current. Uncached, each stat() was a round trip through this daemon
  // (~0.13 ms): a store's update, which looks at each page file it will write before it reads, spent 8 ms of
  // a 970 ms update on them with the disk idle; on a disk's own file system they cost microseconds.
  cfg->attr_timeout = 3600;
  cfg->entry_timeout = 3600;
  cfg->negative_timeout = 0;
  return NULL;
}

static void sd_destroy(void* data) {
  (void)data;
  fprintf(stderr, "slow_disk: read %llu bytes in %llu requests, wrote %llu bytes in %llu requests\n",
          (unsigned long long)bytes_read, (unsigned long long)requests_read, (unsigned long long)bytes_written,
          (unsigned long long)requests_written);
}

static const struct fuse_operations ops = {
    .getattr = sd_getattr,
    .readlink = sd_readlink,
    .mkdir = sd_mkdir,
    .unlink = sd_unlink,
    .rmdir = sd_rmdir,
    .symlink = sd_symlink,
    .rename = sd_rename,
    .link = sd_link,
    .chmod = sd_chmod,
    .truncate = sd_truncate,
    .open = sd_open,
    .read = sd_read,
    .write = sd_write,
    .statfs = sd_statfs,
    .release = sd_release,
    .fsync = sd_fsync,
    .readdir = sd_readdir,
    .fsyncdir = sd_fsyncdir,
    .init = sd_init,
    .destroy = sd_destroy,
    .create = sd_create,
    .utimens = sd_utimens,
    .fallocate = sd_fallocate,
};

int main(int argc, char* argv[]) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s BACKING_DIR READ_GBPS WRITE_GBPS MOUNTPOINT [FUSE options]\n", argv[0]);
    return 2;
  }
  double read_gbps = atof(argv[2]), write_gbps = atof(argv[3]);
  if (!(read_gbps > 0) || !(write_gbps > 0)) {
    fprintf(stderr, "slow_disk: READ_GBPS and WRITE_GBPS must be positive numbers, got %s and %s\n", argv[2],
            argv[3]);
    return 2;
  }
  read_ns_per_byte = 1.0 / read_gbps;  // 1 GB/s = 1 byte per ns
  write_ns_per_byte = 1.0 / write_gbps;
  backing_fd = open(argv[1], O_RDONLY | O_DIRECTORY);
  if (backing_fd == -1) {
    fprintf(stderr, "slow_disk: cannot open the backing directory %s: %s\n", argv[1], strerror(errno));
    return 2;
  }
  // FUSE sees: program, mountpoint, its options.
  char** fuse_argv = calloc((size_t)argc, sizeof(char*));
  int fuse_argc = 0;
  fuse_argv[fuse_argc++] = argv[0];
  for (int i = 4; i < argc; i++) fuse_argv[fuse_argc++] = argv[i];
  int rc = fuse_main(fuse_argc, fuse_argv, &ops, NULL);
  free(fuse_argv);
  return rc;
}
