// An LD_PRELOAD shim for tests/test_clock_jump.py: the wall clock (clock_gettime of CLOCK_REALTIME,
// CLOCK_REALTIME_COARSE and CLOCK_TAI; gettimeofday; time) shifted by the seconds written in the file that
// WALLCLOCK_SHIFT_FILE names, read again at most every 50 ms; a new figure there is a step of the clock. The
// monotonic clock is left as it is, as a real step (settimeofday, an NTP step) leaves it. (libfaketime 0.9.10
// with FAKETIME_DONT_FAKE_MONOTONIC=1 breaks clock_nanosleep: Python's time.sleep fails with EINVAL.)
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

typedef int (*clock_gettime_fn)(clockid_t, struct timespec*);
static clock_gettime_fn real_clock_gettime;
static _Atomic int64_t shift_ns;
static _Atomic int64_t next_read_ns;

static int64_t now_mono(void) {
  struct timespec ts;
  real_clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

__attribute__((constructor)) static void init(void) {
  real_clock_gettime = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
}

static void refresh(void) {
  if (!real_clock_gettime) init();
  int64_t now = now_mono();
  if (now < atomic_load(&next_read_ns)) return;
  atomic_store(&next_read_ns, now + 50000000LL);
  const char* path = getenv("WALLCLOCK_SHIFT_FILE");
  if (!path) return;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  char buf[64];
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return;
  buf[n] = 0;
  atomic_store(&shift_ns, (int64_t)(strtod(buf, NULL) * 1e9));
}

static void shift(struct timespec* ts) {
  int64_t t = (int64_t)ts->tv_sec * 1000000000LL + ts->tv_nsec + atomic_load(&shift_ns);
  ts->tv_sec = t / 1000000000LL;
  ts->tv_nsec = t % 1000000000LL;
  if (ts->tv_nsec < 0) { ts->tv_nsec += 1000000000LL; ts->tv_sec -= 1; }
}

int clock_gettime(clockid_t clk, struct timespec* ts) {
  refresh();
  int r = real_clock_gettime(clk, ts);
  if (r == 0 && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE || clk == CLOCK_TAI)) shift(ts);
  return r;
}

int gettimeofday(struct timeval* restrict tv, void* restrict tz) {
  (void)tz;
  struct timespec ts;
  int r = clock_gettime(CLOCK_REALTIME, &ts);
  if (r == 0) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
  return r;
}

time_t time(time_t* out) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  if (out) *out = ts.tv_sec;
  return ts.tv_sec;
}
