// ortkv._ortkv: the Python face of ortkv_core (the only file that sees pybind11).
#include <pybind11/pybind11.h>

#include <string>

#include "ortkv/core.h"

namespace py = pybind11;

PYBIND11_MODULE(_ortkv, m) {
  m.doc() = "ortkv native core: process-global registries shared with the op library";
  m.def(
      "protect_range",
      [](int device_type, int device_id, uintptr_t addr, uint64_t nbytes, const std::string& label) {
        if (nbytes == 0) throw py::value_error("protect_range: nbytes must be > 0");
        return ortkv_core_protect_range(device_type, device_id, addr, nbytes, label.c_str());
      },
      py::arg("device_type"), py::arg("device_id"), py::arg("addr"), py::arg("nbytes"), py::arg("label") = "",
      "Mark [addr, addr + nbytes) as never to be written by an ortkv kernel; returns an id.");
  m.def(
      "unprotect_range", [](int64_t id) { return ortkv_core_unprotect_range(id) == 1; }, py::arg("id"),
      "Remove a protected range; True if it existed.");
  m.def(
      "find_protected",
      [](int device_type, int device_id, uintptr_t addr, uint64_t nbytes) -> py::object {
        uintptr_t hit = 0;
        uint64_t len = 0;
        char label[256];
        if (!ortkv_core_find_protected(device_type, device_id, addr, nbytes, &hit, &len, label, sizeof(label)))
          return py::none();
        return py::make_tuple(hit, len, std::string(label));
      },
      py::arg("device_type"), py::arg("device_id"), py::arg("addr"), py::arg("nbytes"));
  m.def("protected_count", []() { return ortkv_core_protected_count(); });
  m.def("core_instance", []() { return ortkv_core_instance(); },
        "Address of the process-global registry (one per process).");
  m.attr("DEVICE_CPU") = static_cast<int>(ORTKV_DEVICE_CPU);
  m.attr("DEVICE_CUDA") = static_cast<int>(ORTKV_DEVICE_CUDA);
  m.attr("CUDA_BUILD") = static_cast<bool>(ORTKV_WITH_CUDA_BUILD);
}
