// Placeholder until the CPU Adam kernel lands: a real, importable module.
#include <pybind11/pybind11.h>
PYBIND11_MODULE(_cpu_adam, m) { m.attr("ISA_COMPILED") = pybind11::make_tuple("scalar"); }
