#include <nanobind/nanobind.h>
namespace nb = nanobind;
NB_MODULE(_nsp_ffi, m) { m.def("ping", []() { return 1; }); }
