// ortkv._ortkv: the Python face of ortkv_core (the only file that sees pybind11).
#include <pybind11/pybind11.h>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "arena.h"
#include "codecs.h"
#include "ortkv/core.h"
#include "ortkv/paged.h"

namespace py = pybind11;
using ortkv::vmm::Arena;
using ortkv::vmm::Governor;

namespace {
// Status -> RuntimeError("[ortkv:E_*] ..."); ortkv.vmm turns the tag into the typed error.
void Check(const ortkv::Status& s) {
  if (!s.ok()) throw std::runtime_error(s.Tagged());
}

std::shared_ptr<ortkv::vmm::Backend> BackendFor(const std::string& kind, int device) {
  if (kind == "cpu") return ortkv::vmm::MakeHostBackend();
  std::shared_ptr<ortkv::vmm::Backend> b;
  Check(ortkv::vmm::MakeCudaBackend(device, &b));
  return b;
}
// The logical element type a requantize rounds to, from its numpy name.
int32_t LogicalType(const std::string& logical, const char* fn) {
  if (logical == "float32") return ortkv::kFloat32;
  if (logical == "float16") return ortkv::kFloat16;
  if (logical == "bfloat16") return ortkv::kBFloat16;
  throw py::value_error(std::string("[ortkv:E_INPUT] ") + fn + ": logical must be 'float32', 'float16' or "
                        "'bfloat16', got '" + logical + "'");
}

}  // namespace

PYBIND11_MODULE(_ortkv, m) {
  m.doc() = "ortkv native core: process-global registries shared with the op library";
  m.def(
      "protect_range",
      [](int device_type, int device_id, uintptr_t addr, uint64_t nbytes, const std::string& label, int kind) {
        if (nbytes == 0) throw py::value_error("protect_range: nbytes must be > 0");
        return ortkv_core_protect_range(device_type, device_id, addr, nbytes, label.c_str(), kind);
      },
      py::arg("device_type"), py::arg("device_id"), py::arg("addr"), py::arg("nbytes"), py::arg("label") = "",
      py::arg("kind") = static_cast<int>(ORTKV_RANGE_READONLY),
      "Mark [addr, addr + nbytes) as never to be written by an ortkv kernel; returns an id.");
  m.def(
      "unprotect_range", [](int64_t id) { return ortkv_core_unprotect_range(id) == 1; }, py::arg("id"),
      "Remove a protected range; True if it existed.");
  m.def(
      "find_protected",
      [](int device_type, int device_id, uintptr_t addr, uint64_t nbytes, int kind_mask) -> py::object {
        uintptr_t hit = 0;
        uint64_t len = 0;
        char label[256];
        int kind = ortkv_core_find_protected(device_type, device_id, addr, nbytes, kind_mask, &hit, &len, label,
                                             sizeof(label));
        if (kind == 0) return py::none();
        return py::make_tuple(hit, len, std::string(label), kind);
      },
      py::arg("device_type"), py::arg("device_id"), py::arg("addr"), py::arg("nbytes"), py::arg("kind_mask") = 0,
      "(addr, nbytes, label, kind) of the first protected range overlapping the span, or None.");
  m.def("protected_count", []() { return ortkv_core_protected_count(); });
  // Note [Alias check without wrappers] (session.py): the data pointer of a DLPack capsule, for the post-run
  // pointer check of a session's aliased outputs: ORT's OrtValueVector.to_dlpacks(dlpack_data_ptr) calls it on
  // each output's capsule, in one call, instead of one Python OrtValue per output (~0.7 us each).
  // Note [DLPack capsules are consumed]: the function CONSUMES the capsule, as a DLPack consumer must: it reads
  // the pointer, renames the capsule "used_dltensor" (or "used_dltensor_versioned") and calls the managed
  // tensor's deleter, which drops the producer's reference to the tensor. to_dlpacks hands the callback one
  // capsule without a destructor, re-pointed at a new DLManagedTensor per output ("the object which consumes it
  // is responsible for its deletion"): a callback that only read it leaked every output's managed tensor and
  // with it the tensor itself, i.e. each decode step's logits (192 KiB a step for SmolLM2 on the CPU, ~80 MB
  // per 300 tokens; on CUDA the device buffers). A capsule made by OrtValue.to_dlpack() has a destructor that
  // calls the deleter only while the name is still "dltensor", so renaming it first frees it exactly once.
  m.def(
      "dlpack_data_ptr",
      [](const py::object& capsule) -> uintptr_t {
        // DLPack's C ABI (dlpack.h): DLManagedTensor {DLTensor dl_tensor; void* manager_ctx;
        // void (*deleter)(DLManagedTensor*);} ("dltensor") and DLManagedTensorVersioned {DLPackVersion version;
        // void* manager_ctx; void (*deleter)(...); uint64_t flags; DLTensor dl_tensor;} ("dltensor_versioned");
        // DLTensor {void* data; DLDevice device; int32_t ndim; DLDataType dtype; int64_t* shape;
        // int64_t* strides; uint64_t byte_offset;}.
        struct DLTensorHead {
          void* data;
          int32_t device_type, device_id, ndim;
          uint8_t code, bits;
          uint16_t lanes;
          int64_t* shape;
          int64_t* strides;
          uint64_t byte_offset;
        };
        struct Managed {
          DLTensorHead dl_tensor;
          void* manager_ctx;
          void (*deleter)(Managed*);
        };
        struct Versioned {
          uint32_t major, minor;
          void* manager_ctx;
          void (*deleter)(Versioned*);
          uint64_t flags;
          DLTensorHead dl_tensor;
        };
        static_assert(sizeof(DLTensorHead) == 48, "DLTensor is 48 bytes");
        PyObject* c = capsule.ptr();
        // read the pointer, mark the capsule used, then release the producer's reference (in that order: the
        // deleter may free the tensor and its DLTensor)
        auto consume = [c](auto* t, const char* used) {
          const uintptr_t ptr = reinterpret_cast<uintptr_t>(t->dl_tensor.data) + t->dl_tensor.byte_offset;
          if (PyCapsule_SetName(c, used) != 0) throw py::error_already_set();
          if (t->deleter != nullptr) t->deleter(t);
          return ptr;
        };
        if (PyCapsule_IsValid(c, "dltensor")) {
          return consume(static_cast<Managed*>(PyCapsule_GetPointer(c, "dltensor")), "used_dltensor");
        }
        if (PyCapsule_IsValid(c, "dltensor_versioned")) {
          return consume(static_cast<Versioned*>(PyCapsule_GetPointer(c, "dltensor_versioned")),
                         "used_dltensor_versioned");
        }
        throw py::type_error("dlpack_data_ptr: not an unconsumed DLPack capsule (\"dltensor\" or "
                             "\"dltensor_versioned\")");
      },
      py::arg("capsule"),
      "data + byte_offset of a DLPack capsule; consumes it (renamed used_*, the deleter called: Note [DLPack "
      "capsules are consumed]).");
  m.def(
      "cuda_take_error",
      []() -> py::object {
        char msg[1024];
        if (ortkv_core_take_device_error(msg, sizeof(msg)) == ORTKV_DERR_NONE) return py::none();
        return py::str(msg);
      },
      "The error a CUDA kernel found on the device since the last call (\"[ortkv:E_...] ...\"), cleared; or "
      "None. Note [CUDA deferred errors].");
  m.def("core_instance", []() { return ortkv_core_instance(); },
        "Address of the process-global registry (one per process).");
  m.attr("DEVICE_CPU") = static_cast<int>(ORTKV_DEVICE_CPU);
  m.attr("DEVICE_CUDA") = static_cast<int>(ORTKV_DEVICE_CUDA);
  m.attr("RANGE_READONLY") = static_cast<int>(ORTKV_RANGE_READONLY);
  m.attr("RANGE_UNCOMMITTED") = static_cast<int>(ORTKV_RANGE_UNCOMMITTED);

  m.def("cuda_vmm_available", []() {
    std::string why;
    bool ok = ortkv::vmm::CudaDriverAvailable(&why);
    return py::make_tuple(ok, why);
  });
  m.def("live_mappings", [](int device_type) { return Arena::TotalLiveMappings(device_type); },
        py::arg("device_type"), "Live mappings made by all arenas of one backend kind in this process.");

  py::class_<Governor, std::shared_ptr<Governor>>(m, "Governor")
      .def(py::init<uint64_t>(), py::arg("budget_bytes"))
      .def_property_readonly("budget", &Governor::budget)
      .def_property_readonly("in_use", &Governor::in_use)
      .def_property_readonly("quarantined", &Governor::quarantined);

  py::class_<Arena>(m, "Arena")
      .def(py::init([](uint64_t reserve, const std::string& kind, int device, std::shared_ptr<Governor> gov) {
             std::unique_ptr<Arena> a;
             Check(Arena::Create(BackendFor(kind, device), reserve, std::move(gov), &a));
             return a;
           }),
           py::arg("reserve_bytes"), py::arg("kind"), py::arg("device"), py::arg("governor"))
      .def_property_readonly("base", &Arena::base)
      .def_property_readonly("granule", &Arena::granule)
      .def_property_readonly("reserved_bytes", &Arena::reserved_bytes)
      .def_property_readonly("committed_bytes", &Arena::committed_bytes)
      .def_property_readonly("billed_bytes", &Arena::billed_bytes)
      .def_property_readonly("read_only", &Arena::read_only)
      .def_property_readonly("closed", &Arena::closed)
      .def_property_readonly("quarantined", &Arena::quarantined)
      .def_property_readonly("live_mappings", &Arena::live_mappings)
      .def_property_readonly("backend", [](const Arena& a) { return std::string(a.backend().name()); })
      .def("is_committed", &Arena::IsCommitted, py::arg("offset"), py::arg("nbytes"))
      .def("commit",
           [](Arena& a, uint64_t nbytes, uint64_t offset) {
             uint64_t newly = 0;
             Check(a.Commit(nbytes, offset, &newly));
             return newly;
           },
           py::arg("nbytes"), py::arg("offset") = 0)
      .def("commit_ranges",
           [](Arena& a, const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
             uint64_t newly = 0;
             Check(a.CommitRanges(ranges, &newly));
             return newly;
           },
           py::arg("ranges"), "[(offset, nbytes), ...] in one transaction; returns the bytes newly committed.")
      // release and close wait for kernels in flight (Note [Arena lease]): without the GIL, so that
      // a Python thread running a session is never blocked behind them.
      .def("release",
           [](Arena& a) {
             ortkv::Status s;
             {
               py::gil_scoped_release nogil;
               s = a.Release();
             }
             Check(s);
           })
      .def("close",
           [](Arena& a) {
             bool quarantined = false;
             ortkv::Status s;
             {
               py::gil_scoped_release nogil;
               s = a.Close(&quarantined);
             }
             if (quarantined) return std::string(s.message());
             Check(s);
             return std::string();
           },
           "Close; returns a non-empty reason when the arena was quarantined instead of freed.")
      .def("map_shared_prefix",
           [](Arena& a, uint64_t nbytes) {
             std::unique_ptr<Arena> sharer;
             Check(a.MapSharedPrefix(nbytes, &sharer));
             return sharer;
           },
           py::arg("nbytes"));

  m.def(
      "paged_requantize",
      [](py::array pool, uint64_t src_offset, int32_t src_format, uint64_t dst_offset, int32_t dst_format,
         int32_t num_layers, int32_t kv_heads, int32_t page_size, int32_t head_size, const std::string& logical) {
        // the pool is written in place: refuse anything pybind11 would convert into a copy
        if (!py::isinstance<py::array_t<uint8_t>>(pool) || pool.ndim() != 1 ||
            !(pool.flags() & py::array::c_style) || !pool.writeable()) {
          throw py::value_error("[ortkv:E_INPUT] paged_requantize: pool must be a writable, contiguous uint8 array "
                                "[pool_bytes] (the page pool's bytes, changed in place); got dtype " +
                                std::string(py::str(pool.dtype())) + " of rank " + std::to_string(pool.ndim()));
        }
        const int32_t type = LogicalType(logical, "paged_requantize");
        uint8_t* base = static_cast<uint8_t*>(pool.mutable_data());
        const uint64_t nbytes = static_cast<uint64_t>(pool.shape(0));
        ortkv::Status s;
        {
          py::gil_scoped_release nogil;
          s = ortkv::PagedRequantize(base, nbytes, src_offset, src_format, dst_offset, dst_format, num_layers,
                                     ortkv::codecs::PageShape{kv_heads, page_size, head_size}, type);
        }
        Check(s);
      },
      py::arg("pool"), py::arg("src_offset"), py::arg("src_format"), py::arg("dst_offset"), py::arg("dst_format"),
      py::arg("num_layers"), py::arg("kv_heads"), py::arg("page_size"), py::arg("head_size"), py::arg("logical"),
      "Requantize one page slot (num_layers codec pages) of the pool from src_format at src_offset into "
      "dst_format at dst_offset: DecodePage, rounding to the logical type, EncodePage, every layer. Checks "
      "everything first; on failure (non-finite or unrepresentable values, bad offsets) nothing is written.");

#if ORTKV_WITH_CUDA_BUILD
  m.def(
      "paged_requantize_cuda",
      [](int32_t device, uintptr_t pool, uint64_t pool_bytes, uint64_t src_offset, int32_t src_format,
         uint64_t dst_offset, int32_t dst_format, int32_t num_layers, int32_t kv_heads, int32_t page_size,
         int32_t head_size, const std::string& logical) {
        const int32_t type = LogicalType(logical, "paged_requantize_cuda");
        ortkv::Status s;
        {
          py::gil_scoped_release nogil;
          s = ortkv::PagedRequantizeCuda(device, reinterpret_cast<uint8_t*>(pool), pool_bytes, src_offset, src_format,
                                         dst_offset, dst_format, num_layers,
                                         ortkv::codecs::PageShape{kv_heads, page_size, head_size}, type);
        }
        Check(s);
      },
      py::arg("device"), py::arg("pool"), py::arg("pool_bytes"), py::arg("src_offset"), py::arg("src_format"),
      py::arg("dst_offset"), py::arg("dst_format"), py::arg("num_layers"), py::arg("kv_heads"), py::arg("page_size"),
      py::arg("head_size"), py::arg("logical"),
      "paged_requantize on a pool in CUDA device memory (pool: its device address on cuda:device), by kernels on "
      "the device (Note [Requantize on CUDA]): the same bytes, checks and messages; nothing written on refusal.");
#endif

  // Test hooks, kept out of the public surface: only the test suite imports ortkv._ortkv._testing.
  py::module_ testing = m.def_submodule("_testing", "ortkv test hooks (not a public API)");
  testing.def(
      "inject_fault", [](Arena& a, const std::string& op, int64_t countdown) { a.InjectFault(op, countdown); },
      py::arg("arena"), py::arg("op"), py::arg("countdown") = 0,
      "Make the countdown-th next call of op (grant, create, map, set_access, unmap, release, synchronize, "
      "free) fail once in this arena.");
  testing.def("lease_acquire", [](bool exclusive) { ortkv_core_lease_acquire(exclusive ? 1 : 0); },
              py::arg("exclusive") = false, py::call_guard<py::gil_scoped_release>(),
              "Take the kernels' arena lease, as a kernel does around its check and write.");
  testing.def("lease_release", [](bool exclusive) { ortkv_core_lease_release(exclusive ? 1 : 0); },
              py::arg("exclusive") = false);

  // Page codecs (custom_ops/codecs), for the byte-exact comparison with ortkv.reference.codecs.
  using ortkv::codecs::PageShape;
  using ortkv::codecs::PageView;
  testing.def(
      "codec_layout",
      [](int32_t format, int32_t kv_heads, int32_t page_size, int32_t head_size) {
        const PageShape s{kv_heads, page_size, head_size};
        Check(ortkv::codecs::ValidateShape(format, s));
        const auto l = ortkv::codecs::LayoutOf(static_cast<ortkv::codecs::PageFormat>(format), s);
        py::dict d;
        d["row_bytes"] = l.row_bytes;
        d["scale_row_bytes"] = l.scale_row_bytes;
        d["k_payload"] = l.k_payload;
        d["v_payload"] = l.v_payload;
        d["k_scales"] = l.k_scales;
        d["v_scales"] = l.v_scales;
        d["page_bytes"] = l.page_bytes;
        d["ideal_bytes"] = l.ideal_bytes;
        return d;
      },
      py::arg("format"), py::arg("kv_heads"), py::arg("page_size"), py::arg("head_size"));
  testing.def(
      "codec_encode_page",
      [](int32_t format, py::array_t<float, py::array::c_style | py::array::forcecast> values,
         py::array_t<uint8_t, py::array::c_style> page) {
        if (values.ndim() != 4 || values.shape(0) != 2) throw py::value_error("values must be [2, kv_heads, page_size, head_size]");
        const PageShape s{static_cast<int32_t>(values.shape(1)), static_cast<int32_t>(values.shape(2)),
                          static_cast<int32_t>(values.shape(3))};
        Check(ortkv::codecs::ValidateShape(format, s));
        const PageView v = PageView::Make(page.mutable_data(), static_cast<ortkv::codecs::PageFormat>(format), s);
        if (page.ndim() != 1 || static_cast<uint64_t>(page.shape(0)) != v.layout.page_bytes) throw py::value_error("page must be uint8 [page_bytes]");
        Check(ortkv::codecs::EncodePage(v, values.data()));
      },
      py::arg("format"), py::arg("values"), py::arg("page"),
      "Encode values [2, kv_heads, page_size, head_size] into page (uint8 [page_bytes]) in place.");
  testing.def(
      "codec_decode_page",
      [](int32_t format, int32_t kv_heads, int32_t page_size, int32_t head_size,
         py::array_t<uint8_t, py::array::c_style> page) {
        const PageShape s{kv_heads, page_size, head_size};
        Check(ortkv::codecs::ValidateShape(format, s));
        const PageView v = PageView::Make(page.mutable_data(), static_cast<ortkv::codecs::PageFormat>(format), s);
        if (page.ndim() != 1 || static_cast<uint64_t>(page.shape(0)) != v.layout.page_bytes) throw py::value_error("page must be uint8 [page_bytes]");
        py::array_t<float> out({py::ssize_t{2}, py::ssize_t{kv_heads}, py::ssize_t{page_size}, py::ssize_t{head_size}});
        Check(ortkv::codecs::DecodePage(v, out.mutable_data()));
        return out;
      },
      py::arg("format"), py::arg("kv_heads"), py::arg("page_size"), py::arg("head_size"), py::arg("page"));
  testing.def(
      "codec_encode_row",
      [](int32_t format, int32_t kv_heads, int32_t page_size, py::array_t<uint8_t, py::array::c_style> page,
         int32_t kv, int32_t head, int32_t token, py::array_t<float, py::array::c_style | py::array::forcecast> row) {
        const PageShape s{kv_heads, page_size, static_cast<int32_t>(row.size())};
        Check(ortkv::codecs::ValidateShape(format, s));
        const PageView v = PageView::Make(page.mutable_data(), static_cast<ortkv::codecs::PageFormat>(format), s);
        if (page.ndim() != 1 || static_cast<uint64_t>(page.shape(0)) != v.layout.page_bytes) throw py::value_error("page must be uint8 [page_bytes]");
        Check(ortkv::codecs::EncodeRowInto(v, kv, head, token, row.data()));
      },
      py::arg("format"), py::arg("kv_heads"), py::arg("page_size"), py::arg("page"), py::arg("kv"), py::arg("head"),
      py::arg("token"), py::arg("row"), "Direct write of one row (head_size = row.size) into page, in place.");
  testing.def(
      "codec_scalar",
      [](const std::string& conv, py::array_t<float, py::array::c_style | py::array::forcecast> x) {
        py::array_t<float> out(x.size());
        const float* in = x.data();
        float* o = out.mutable_data();
        for (py::ssize_t i = 0; i < x.size(); ++i) {
          if (conv == "f16") o[i] = ortkv::codecs::F16BitsToF32(ortkv::codecs::F32ToF16Bits(in[i]));
          else if (conv == "bf16") o[i] = ortkv::codecs::BF16BitsToF32(ortkv::codecs::F32ToBF16Bits(in[i]));
          else if (conv == "e4m3") o[i] = static_cast<float>(ortkv::codecs::F32ToE4M3(in[i]));
          else throw py::value_error("conv must be f16, bf16 or e4m3");
        }
        return out;
      },
      py::arg("conv"), py::arg("x"),
      "Round-trip each value through float16 / bfloat16, or give its e4m3fn code (saturating), for the "
      "conversion tests.");

  m.attr("CUDA_BUILD") = static_cast<bool>(ORTKV_WITH_CUDA_BUILD);
}
