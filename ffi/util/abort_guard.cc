// The abort guard (abort_guard.h). Everything the handler does is async-signal-safe: socket, fcntl, connect,
// poll, getsockopt, close, write and _exit, on values prepared when the guard was installed.
#include "util/abort_guard.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace nsp {
namespace {

// What the handler needs, prepared before it can run (a signal handler may not allocate).
struct Guard {
  sockaddr_storage addr;
  socklen_t addr_len = 0;
  int probe_ms = 0;
  int exit_code = 0;
  char message[2048];
  size_t message_len = 0;
};
Guard g_guard;
volatile sig_atomic_t g_installed = 0;

// Whether the coordination service still accepts a connection within the probe time.
bool ServiceReachable() {
  const int fd = ::socket(g_guard.addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;  // cannot tell: leave the abort as it is
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  bool reachable = false;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&g_guard.addr), g_guard.addr_len) == 0) {
    reachable = true;
  } else if (errno == EINPROGRESS) {  // a remote host: wait for the handshake, at most probe_ms
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, g_guard.probe_ms) == 1) {
      int err = 0;
      socklen_t len = sizeof err;
      reachable = ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
    }
  }
  ::close(fd);
  return reachable;
}

void OnAbort(int) {
  const int saved_errno = errno;
  if (g_installed && !ServiceReachable()) {
    size_t done = 0;
    while (done < g_guard.message_len) {
      const ssize_t w = ::write(STDERR_FILENO, g_guard.message + done, g_guard.message_len - done);
      if (w <= 0) break;
      done += static_cast<size_t>(w);
    }
    ::_exit(g_guard.exit_code);
  }
  errno = saved_errno;  // returning lets abort() restore the default action and end the process as before
}

}  // namespace

std::string InstallAbortGuard(const std::string& host, int port, int probe_ms, const std::string& message,
                              int exit_code) {
  if (port <= 0 || port > 65535) return "abort guard: port " + std::to_string(port) + " is out of range";
  if (message.size() + 1 > sizeof g_guard.message) return "abort guard: the message is too long";
  Guard guard;
  std::memset(&guard.addr, 0, sizeof guard.addr);
  auto* v4 = reinterpret_cast<sockaddr_in*>(&guard.addr);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&guard.addr);
  if (::inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    guard.addr_len = sizeof(sockaddr_in);
  } else if (::inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    guard.addr_len = sizeof(sockaddr_in6);
  } else {
    return "abort guard: '" + host + "' is not a numeric IPv4 or IPv6 address";
  }
  guard.probe_ms = probe_ms;
  guard.exit_code = exit_code;
  std::memcpy(guard.message, message.data(), message.size());
  guard.message_len = message.size();
  g_installed = 0;  // a handler running meanwhile sees no half-copied guard
  g_guard = guard;
  struct sigaction action;
  std::memset(&action, 0, sizeof action);
  action.sa_handler = OnAbort;
  sigemptyset(&action.sa_mask);
  if (::sigaction(SIGABRT, &action, nullptr) != 0) {
    return std::string("abort guard: sigaction: ") + std::strerror(errno);
  }
  g_installed = 1;
  return {};
}

void RemoveAbortGuard() {
  g_installed = 0;
  ::signal(SIGABRT, SIG_DFL);
}

}  // namespace nsp
