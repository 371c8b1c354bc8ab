// Helpers shared by the op adapters.
#include "ort_util.h"

#include <climits>
#include <cstring>
#include <sstream>

#include "ortkv/core.h"

namespace ortkv_ort {

OrtStatus* ReadTensor(const OrtValue* value, const std::string& name, ortkv::TensorArg* out, int* device_type,
                      int* device_id) {
  // the value's own type and shape, read in place (C API 24+): no OrtTensorTypeAndShapeInfo is made and released per
  // input per run (Note [Messages on the error path only]: these adapters run on every call of every node)
  ONNXTensorElementDataType type;
  const int64_t* shape = nullptr;
  size_t rank = 0;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorElementTypeAndShapeDataReference(value, &type, &shape, &rank));
  out->dims.assign(shape, shape + rank);
  out->elem_type = static_cast<int32_t>(type);
  out->name = name;
  void* data = nullptr;
  ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorMutableData(const_cast<OrtValue*>(value), &data));
  out->data = data;
  if (device_type != nullptr) {
    const OrtMemoryInfo* mem = nullptr;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->GetTensorMemoryInfo(value, &mem));
    OrtMemoryInfoDeviceType dt;
    g_api->MemoryInfoGetDeviceType(mem, &dt);
    *device_type = dt == OrtMemoryInfoDeviceType_GPU ? ORTKV_DEVICE_CUDA : ORTKV_DEVICE_CPU;
    ORTKV_RETURN_IF_ORT_ERROR(g_api->MemoryInfoGetId(mem, device_id));
  }
  return nullptr;
}

std::string Hex(const void* p) {
  std::ostringstream s;
  s << "0x" << std::hex << reinterpret_cast<uintptr_t>(p);
  return s.str();
}

OrtStatus* ReadNodeNames(const OrtApi* api, const OrtKernelInfo* info, size_t inputs, size_t outputs, NodeNames* out) {
  ORTKV_RETURN_IF_ORT_ERROR(
      ReadString([&](char* b, size_t* n) { return api->KernelInfo_GetNodeName(info, b, n); }, &out->node));
  out->inputs.assign(inputs, "");
  out->outputs.assign(outputs, "");
  for (size_t i = 0; i < inputs; ++i) {
    ORTKV_RETURN_IF_ORT_ERROR(ReadString(
        [&](char* b, size_t* n) { return api->KernelInfo_GetInputName(info, i, b, n); }, &out->inputs[i]));
  }
  for (size_t i = 0; i < outputs; ++i) {
    ORTKV_RETURN_IF_ORT_ERROR(ReadString(
        [&](char* b, size_t* n) { return api->KernelInfo_GetOutputName(info, i, b, n); }, &out->outputs[i]));
  }
  return nullptr;
}

void InitCustomOp(OrtCustomOp* op) {
  std::memset(op, 0, sizeof(*op));
  op->version = ORT_API_VERSION;
  op->GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };
  op->GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
  op->GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
  op->GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
  op->GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  op->GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op->GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  op->GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op->GetStartVersion = [](const OrtCustomOp*) { return 1; };
  op->GetEndVersion = [](const OrtCustomOp*) { return INT_MAX; };
}

namespace {
template <typename T, typename Get>
OrtStatus* Optional(const OrtApi* api, const std::string& node, const char* name, const char* type, T fallback,
                    T* out, Get&& get) {
  OrtStatus* s = get();
  if (s == nullptr) return nullptr;
  const std::string why = api->GetErrorMessage(s);
  api->ReleaseStatus(s);
  if (why.find("No attribute with name") != std::string::npos) {
    *out = fallback;
    return nullptr;
  }
  const std::string m = "[ortkv:E_INPUT] node '" + node + "': attribute '" + name + "' must be " + type +
                        " (ONNX Runtime: " + why + "); it is not read as absent";
  return api->CreateStatus(ORT_INVALID_ARGUMENT, m.c_str());
}
}  // namespace

OrtStatus* OptionalAttribute(const OrtApi* api, const OrtKernelInfo* info, const std::string& node, const char* name,
                             int64_t fallback, int64_t* out) {
  return Optional(api, node, name, "an int", fallback, out,
                  [&] { return api->KernelInfoGetAttribute_int64(info, name, out); });
}

OrtStatus* OptionalAttribute(const OrtApi* api, const OrtKernelInfo* info, const std::string& node, const char* name,
                             float fallback, float* out) {
  return Optional(api, node, name, "a float", fallback, out,
                  [&] { return api->KernelInfoGetAttribute_float(info, name, out); });
}

OrtStatus* OptionalAttribute(const OrtApi* api, const OrtKernelInfo* info, const std::string& node, const char* name,
                             const std::string& fallback, std::string* out) {
  size_t size = 0;
  bool present = false;
  ORTKV_RETURN_IF_ORT_ERROR(Optional(api, node, name, "a string", fallback, out, [&] {
    OrtStatus* s = api->KernelInfoGetAttribute_string(info, name, nullptr, &size);  // the size query first
    present = s == nullptr;
    return s;
  }));
  if (!present) return nullptr;
  std::vector<char> buf(size + 1, '\0');
  ORTKV_RETURN_IF_ORT_ERROR(api->KernelInfoGetAttribute_string(info, name, buf.data(), &size));
  out->assign(buf.data());
  return nullptr;
}

int64_t InferAttr(OrtShapeInferContext* ctx, const char* name, int64_t fallback) {
  const OrtOpAttr* attr = nullptr;
  OrtStatus* s = g_api->ShapeInferContext_GetAttribute(ctx, name, &attr);
  if (s != nullptr || attr == nullptr) {
    if (s != nullptr) g_api->ReleaseStatus(s);
    return fallback;
  }
  int64_t v = fallback;
  size_t got = 0;
  s = g_api->ReadOpAttr(attr, ORT_OP_ATTR_INT, &v, sizeof(v), &got);
  if (s != nullptr) {
    g_api->ReleaseStatus(s);
    return fallback;
  }
  return v;
}

}  // namespace ortkv_ort
