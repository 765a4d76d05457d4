// Turning the JAX runtime's abort after the loss of a run's coordination service into a clear exit.
//
// When process 0 of a multi-process run dies, JAX's distributed-runtime client in every other process ends its
// process with abort() (SIGABRT) the moment it polls the service, before any Python code can say why. The guard
// installs a SIGABRT handler that, only when the service's address no longer accepts connections, writes a
// message and exits with a chosen status (the run's "resume me" status); any other abort goes on as before.
#pragma once

#include <string>

namespace nsp {

// Installs the guard for the coordination service at `host` (a numeric IPv4 or IPv6 address) and `port`. On a
// SIGABRT the handler tries to connect there (up to `probe_ms` milliseconds); if that fails, it writes `message`
// to stderr and calls _exit(`exit_code`); otherwise it returns and the abort proceeds. Returns "" or an error.
std::string InstallAbortGuard(const std::string& host, int port, int probe_ms, const std::string& message,
                              int exit_code);

// Removes the guard (the default SIGABRT action again).
void RemoveAbortGuard();

}  // namespace nsp
