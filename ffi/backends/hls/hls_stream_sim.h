// A stand-in for Vitis HLS's hls::stream, so the updater kernel compiles and runs under plain g++ (C simulation)
// with no Xilinx headers. Under Vitis HLS synthesis (__SYNTHESIS__ defined) the real header is used instead.
//
// C simulation runs the processes of a DATAFLOW region one after another, each to completion, so a stream must
// hold everything its producer writes before the consumer starts: like Vitis's own C simulation model, this FIFO
// is unbounded (std::deque); the depth pragmas only matter to the hardware. Reading an empty stream is a bug in
// the kernel's producer/consumer pairing (a count mismatch between two stages), so it stops the program with the
// stream's name instead of returning a default value that would hide it.
#pragma once

#if defined(__SYNTHESIS__)
#include <hls_stream.h>
#else

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <string>

namespace hls {

template <typename T>
class stream {
 public:
  stream() : name_("unnamed") {}
  explicit stream(const char* name) : name_(name) {}
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;

  void write(const T& value) { fifo_.push_back(value); }

  T read() {
    if (fifo_.empty()) {
      std::fprintf(stderr, "hls_stream_sim: read from empty stream '%s' (producer and consumer disagree on counts)\n",
                   name_.c_str());
      std::abort();
    }
    T value = fifo_.front();
    fifo_.pop_front();
    return value;
  }

  void operator<<(const T& value) { write(value); }
  void operator>>(T& value) { value = read(); }

  bool empty() const { return fifo_.empty(); }
  bool full() const { return false; }  // unbounded in C simulation
  std::size_t size() const { return fifo_.size(); }
  const char* name() const { return name_.c_str(); }

 private:
  std::string name_;
  std::deque<T> fifo_;
};

}  // namespace hls

#endif  // __SYNTHESIS__
